"""One attention forward: choose the path (Triton kernels or PyTorch reference), run it, fill ``out``."""

from __future__ import annotations

import os

import torch

from lowbit_attn.inference.prepare import quantize_qkv, quantize_qkv_fp4
from lowbit_attn.core.operands import Seqs
from lowbit_attn.core.recipes import Recipe
from lowbit_attn.inference.naive import exact_attention, fp4_attention, quantized_attention


def _dense_reference(q, k, v, *, recipe: Recipe, scale: float, causal_offset, return_lse: bool):
    if recipe.is_exact:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return exact_attention(q, k, v, scale=scale, causal_offset=causal_offset, dtype=dtype)
    if recipe.is_fp4:
        qz = quantize_qkv_fp4(q, k, v, recipe, scale, need_lse_shift=return_lse,
                              backend="reference")
        return fp4_attention(
            qz, head_dim=q.shape[-1], block_q=recipe.block_q, block_k=recipe.block_k,
            causal_offset=causal_offset, two_level=recipe.two_level_p,
        )
    qz = quantize_qkv(q, k, v, recipe, scale, need_lse_shift=return_lse, backend="reference")
    return quantized_attention(
        qz, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
        block_k=recipe.block_k, causal_offset=causal_offset,
    )


def _dense(q, k, v, *, out, recipe: Recipe, scale: float, causal_offset, return_lse: bool,
           backend: str):
    """Dense ``[B, H, N, D]`` attention into ``out``; the LSE when ``return_lse``."""
    if backend == "triton" and recipe.is_fp4:
        from lowbit_attn.inference import kernel_fp4 as attn_fwd_fp4

        qz = quantize_qkv_fp4(q, k, v, recipe, scale, need_lse_shift=return_lse,
                              backend="triton")
        return attn_fwd_fp4.attention(
            qz, out=out, head_dim=q.shape[-1], block_q=recipe.block_q, block_k=recipe.block_k,
            causal_offset=causal_offset, two_level=recipe.two_level_p, return_lse=return_lse,
        )
    o, lse = _dense_reference(q, k, v, recipe=recipe, scale=scale, causal_offset=causal_offset,
                              return_lse=return_lse)
    out.copy_(o)
    return lse.float() if return_lse else None


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """``os.environ[name]``, one of ``choices`` (the first when unset)."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


Q_QUANT_MODES = ("pass", "kernel")


def q_in_kernel() -> bool:
    """Whether the INT8 attention kernel quantizes Q itself (``LOWBIT_ATTN_Q_QUANT=kernel``: one
    launch and 2 bytes per Q element fewer than a separate pass, for some work in every query
    tile's prologue) or a separate pass does (``pass``, the default). Both give the same bits.

    Not the default, from the sm_90a code (ptxas, SASS; 2026-11-22): a Q tile quantized in
    registers stays there as the wgmma's A operand (16 more registers per thread across the loop),
    which spills with per-token FP8 at D=128 and, at D=64, keeps ptxas from moving the softmax under
    the next Q·Kᵀ in the pipelined loop. The GPU benchmark (``bench_hopper.py``) times both."""
    return _env_choice("LOWBIT_ATTN_Q_QUANT", Q_QUANT_MODES) == "kernel"


KV_STATS_MODES = ("launch", "program")


def kv_stats_in_program() -> bool:
    """Whether K's and V's channel statistics are computed by the launch that quantizes them, one
    program per (batch, head) reading the tensor twice (``LOWBIT_ATTN_KV_STATS=program``: 4 bytes
    per K/V element fewer from HBM when the second read hits L2, but only B·H programs per tensor),
    or by the statistics launch with Q's (``launch``, the default). Both give the same values up to
    the order of the sums."""
    return _env_choice("LOWBIT_ATTN_KV_STATS", KV_STATS_MODES) == "program"


def _as_dense(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a packed ``[total, H, D]`` tensor as a ``[1, H, n, D]`` view."""
    return x[lo:hi].transpose(0, 1).unsqueeze(0)


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    recipe: Recipe,
    scale: float,
    is_causal: bool,
    causal_offset: int,
    return_lse: bool,
    backend: str,
    seqs: tuple[Seqs, Seqs] | None = None,
) -> torch.Tensor | None:
    """Attention of logical ``[B, H, N, D]`` views (or packed ``[total, H, D]`` tensors with
    ``seqs``) written into ``out``; returns the natural-log LSE when ``return_lse``.

    ``causal_offset``: key ``j`` is visible to query ``i`` iff ``j <= i + causal_offset`` (dense
    calls only; packed sequences are each aligned bottom-right).
    """
    offset = causal_offset if is_causal else None
    int8_kernels = backend == "triton" and not recipe.is_exact and not recipe.is_fp4
    if int8_kernels:
        from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

        seqs_q, seqs_k = seqs if seqs is not None else (None, None)
        qz = quantize_qkv(
            q, k, v, recipe, scale, need_lse_shift=return_lse, backend="triton",
            seqs_q=seqs_q, seqs_k=seqs_k, q_in_kernel=q_in_kernel(),
            kv_stats_in_program=kv_stats_in_program(),
        )
        return attn_fwd_int8.attention(
            qz, out=out, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
            block_k=recipe.block_k, causal_offset=offset, return_lse=return_lse,
            seqs_q=seqs_q, seqs_k=seqs_k,
        )
    if seqs is None:
        return _dense(q, k, v, out=out, recipe=recipe, scale=scale, causal_offset=offset,
                      return_lse=return_lse, backend=backend)
    # packed sequences without a packed kernel: one dense call per sequence
    seqs_q, seqs_k = seqs
    bounds_q, bounds_k = (s.cu_seqlens.tolist() for s in seqs)  # host offsets for the loop
    lse_all = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device) if return_lse else None
    for b in range(seqs_q.batch):
        q0, q1 = bounds_q[b], bounds_q[b + 1]
        k0, k1 = bounds_k[b], bounds_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            out[q0:q1].zero_()
            continue
        seq_offset = (k1 - k0) - (q1 - q0) if is_causal else None
        lse = _dense(
            _as_dense(q, q0, q1), _as_dense(k, k0, k1), _as_dense(v, k0, k1),
            out=_as_dense(out, q0, q1), recipe=recipe, scale=scale, causal_offset=seq_offset,
            return_lse=return_lse, backend=backend,
        )
        if return_lse:
            lse_all[:, q0:q1] = lse[0]
    return lse_all
