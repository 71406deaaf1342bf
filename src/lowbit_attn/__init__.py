"""lowbit_attn: fast, accurate low-bit attention for PyTorch, written in Triton."""

from . import fp4, parallel, tiles, vsa
from .api import attention, attention_varlen, scaled_dot_product_attention
from .metrics import Errors, errors
from .patching import patch_sdpa, unpatch_sdpa
from .recipes import RECIPES, TRAIN_RECIPES, Recipe, TrainRecipe, get_recipe
from .trainable import trainable_attention
from .vsa import video_sparse_attention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "scaled_dot_product_attention",
    "patch_sdpa",
    "unpatch_sdpa",
    "trainable_attention",
    "video_sparse_attention",
    "vsa",
    "parallel",
    "tiles",
    "TrainRecipe",
    "TRAIN_RECIPES",
    "Recipe",
    "RECIPES",
    "get_recipe",
    "errors",
    "fp4",
    "Errors",
    "__version__",
]
