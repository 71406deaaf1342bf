"""lowbit_attn: fast, accurate low-bit attention for PyTorch, written in Triton."""

from . import fp4
from .api import attention, attention_varlen, scaled_dot_product_attention
from .metrics import Errors, errors
from .recipes import RECIPES, Recipe, get_recipe

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "scaled_dot_product_attention",
    "Recipe",
    "RECIPES",
    "get_recipe",
    "errors",
    "fp4",
    "Errors",
    "__version__",
]
