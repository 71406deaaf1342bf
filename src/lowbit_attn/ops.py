"""The attention forwards (dense and packed) as ``torch.library`` custom ops with fake
implementations, so ``torch.compile`` traces calls to the public functions without graph breaks and
the ops stay opaque to it (quantization and kernel launches inside)."""

from __future__ import annotations

import torch

from . import forward
from .arch import backend_for
from .quantized import Seqs
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
    recipe = _recipe(recipe_name, qk, pv, granularity, smooth_k, smooth_q, smooth_v, balance_qk,
                     two_level_p, block_q, block_k)
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


def _recipe(recipe_name, qk, pv, granularity, smooth_k, smooth_q, smooth_v, balance_qk,
            two_level_p, block_q, block_k) -> Recipe:
    return Recipe(
        name=recipe_name, qk=qk, pv=pv, granularity=granularity, smooth_k=smooth_k,
        smooth_q=smooth_q, smooth_v=smooth_v, balance_qk=balance_qk, two_level_p=two_level_p,
        block_q=block_q, block_k=block_k,
    )


@torch.library.custom_op("lowbit_attn::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
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
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of validated packed ``[total, H, D]`` sequences; the output in q's shape and
    the LSE ``[Hq, total_q]`` (an empty tensor unless ``return_lse``)."""
    recipe = _recipe(recipe_name, qk, pv, granularity, smooth_k, smooth_q, smooth_v, balance_qk,
                     two_level_p, block_q, block_k)
    batch = cu_seqlens_q.numel() - 1
    seqs = tuple(Seqs(batch, max(n, 1), cu.to(torch.int32))
                 for cu, n in ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k)))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = forward.run(
        q, k, v, out=out, recipe=recipe, scale=scale, is_causal=is_causal, causal_offset=0,
        return_lse=return_lse, backend=backend_for(q.device), seqs=seqs,
    )
    if lse is None:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    return out, lse


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, recipe_name, qk, pv,
      granularity, smooth_k, smooth_q, smooth_v, balance_qk, two_level_p, block_q, block_k, scale,
      is_causal, return_lse):
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q), lse


def call_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, recipe: Recipe, *, scale: float,
                is_causal: bool, return_lse: bool):
    """Run the packed op with a :class:`Recipe`."""
    return attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *recipe_args(recipe), scale,
                                is_causal, return_lse)


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
