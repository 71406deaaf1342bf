"""The KV-cache recipes: how V is stored and, with it, how P̃ meets V.

K is INT8 per token in both (``quantize.py``). The recipe picks V's format on a full page and the
format of P̃ in the P̃·V product:

``kv_int8_fp8``
    V in E4M3 with one scale per (page, head, channel), ``amax/448``; P̃ in E4M3 with the static
    scale 448 (``exp2(S - m + log2 448)``), as the ``qk_int8_pv_fp8`` attention recipe.
``kv_int8_int8``
    V in INT8 with one scale per (page, head, channel), ``amax/127``; P̃ in fp16 (``exp2(S - m)``
    in [0, 1]), as the ``qk_int8_pv_fp16`` recipe: INT8 V is exact in fp16, so a kernel on GPUs
    without FP8 tensor cores converts it and runs an fp16 P·V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit_attn.core import checks


@dataclass(frozen=True)
class KVRecipe:
    """Attributes:
        name: the recipe's name.
        v_dtype: the storage dtype of V on a full page (``float8_e4m3fn`` or ``int8``).
        pv: the format of P̃ in P̃·V, as the attention recipes name it (``"fp8"`` or ``"fp16"``).
    """

    name: str
    v_dtype: torch.dtype
    pv: str


KV_RECIPES = {
    "kv_int8_fp8": KVRecipe("kv_int8_fp8", torch.float8_e4m3fn, "fp8"),
    "kv_int8_int8": KVRecipe("kv_int8_int8", torch.int8, "fp16"),
}


def get_kv_recipe(name) -> KVRecipe:
    """The recipe called ``name`` (a ``ValueError`` naming the choices otherwise)."""
    return KV_RECIPES[checks.choice("recipe", name, tuple(KV_RECIPES))]
