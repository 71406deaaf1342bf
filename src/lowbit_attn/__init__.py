"""lowbit_attn: fast, accurate low-bit attention for PyTorch, written in Triton."""

from lowbit_attn import fp4, parallel, tiles, vsa
from lowbit_attn.core.metrics import Errors, errors
from lowbit_attn.core.recipes import RECIPES, TRAIN_RECIPES, Recipe, TrainRecipe, get_recipe
from lowbit_attn.inference import attention, attention_varlen
from lowbit_attn.integrations.sdpa import patch_sdpa, scaled_dot_product_attention, unpatch_sdpa
from lowbit_attn.training import trainable_attention
from lowbit_attn.vsa import video_sparse_attention

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
