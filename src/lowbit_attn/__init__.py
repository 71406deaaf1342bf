"""lowbit_attn: fast, accurate low-bit attention for PyTorch, written in Triton."""

import sys

from lowbit_attn.core import arch as _arch, triton_support as _triton_support

# the kernels compute alike under each Triton's interpreter
if _arch.interpreter_enabled() and _triton_support.triton_installed():
    _triton_support.patch_interpreter()

from lowbit_attn import vsa  # noqa: E402
from lowbit_attn.integrations import parallel
from lowbit_attn.quant import fp4_interface as fp4
from lowbit_attn.vsa import tiles
from lowbit_attn.core.metrics import Errors, errors
from lowbit_attn.core.recipes import RECIPES, TRAIN_RECIPES, Recipe, TrainRecipe, get_recipe
from lowbit_attn.inference import attention, attention_varlen
from lowbit_attn.kvcache import DecodeStep, QuantizedKVCache, attention_with_kv_cache
from lowbit_attn.integrations.sdpa import patch_sdpa, scaled_dot_product_attention, unpatch_sdpa
from lowbit_attn.training import trainable_attention
from lowbit_attn.vsa import video_sparse_attention

__version__ = "0.1.0"
"""The package's version (PEP 440): the ``version`` of ``pyproject.toml``."""

# The public module paths lowbit_attn.fp4, .parallel and .tiles (``import lowbit_attn.fp4``, ``from
# lowbit_attn.parallel import ring_attention``) name the modules that live in the family folders.
for _name, _module in (("fp4", fp4), ("parallel", parallel), ("tiles", tiles)):
    sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module

# Triton's own cache key, hashed while the caller gets ready (its first compile would wait for it)
if _triton_support.hash_ahead_wanted(_arch.interpreter_enabled()):
    _triton_support.hash_ahead()

__all__ = [
    "attention",
    "attention_varlen",
    "QuantizedKVCache",
    "attention_with_kv_cache",
    "DecodeStep",
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
