"""The dense attention forward as a ``torch.library`` custom op with a fake implementation, so
``torch.compile`` traces calls to the public functions without graph breaks and the op stays opaque
to it (quantization and kernel launches inside)."""

from __future__ import annotations

import torch

from . import forward
from .arch import backend_for
from .recipes import Recipe


@torch.library.custom_op("lowbit_attn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe_name: str,
    qk: str,
    pv: str,
    granularity: str,
    smooth_k: bool,
    smooth_q: bool,
    smooth_v: bool,
    balance_qk: bool,
    two_level_p: bool,
    block_q: int,
    block_k: int,
    scale: float,
    is_causal: bool,
    causal_offset: int,
    nhd: bool,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated ``q, k, v`` in layout HND (``nhd`` False) or NHD; returns the output
    in q's shape (contiguous) and the LSE ``[B, Hq, Nq]`` (an empty tensor unless ``return_lse``)."""
    recipe = Recipe(
        name=recipe_name, qk=qk, pv=pv, granularity=granularity, smooth_k=smooth_k,
        smooth_q=smooth_q, smooth_v=smooth_v, balance_qk=balance_qk, two_level_p=two_level_p,
        block_q=block_q, block_k=block_k,
    )
    qh, kh, vh = (x.transpose(1, 2) if nhd else x for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = forward.run(
        qh, kh, vh, out=out.transpose(1, 2) if nhd else out, recipe=recipe, scale=scale,
        is_causal=is_causal, causal_offset=causal_offset, return_lse=return_lse,
        backend=backend_for(q.device),
    )
    if lse is None:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, recipe_name, qk, pv, granularity, smooth_k, smooth_q, smooth_v, balance_qk,
      two_level_p, block_q, block_k, scale, is_causal, causal_offset, nhd, return_lse):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    b, hq, nq = (q.shape[0], q.shape[2], q.shape[1]) if nhd else q.shape[:3]
    lse = torch.empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    return out, lse


def recipe_args(recipe: Recipe) -> tuple:
    """A :class:`Recipe`'s fields in the op's argument order."""
    return (
        recipe.name, recipe.qk, recipe.pv, recipe.granularity, recipe.smooth_k, recipe.smooth_q,
        recipe.smooth_v, recipe.balance_qk, recipe.two_level_p, recipe.block_q, recipe.block_k,
    )


def call(q, k, v, recipe: Recipe, *, scale: float, is_causal: bool, causal_offset: int,
         nhd: bool, return_lse: bool):
    """Run the op with a :class:`Recipe` (its fields become the op's arguments)."""
    return attention_fwd(
        q, k, v, *recipe_args(recipe), scale, is_causal, causal_offset, nhd, return_lse
    )
