"""Smoothing, balancing and quantization of Q, K, V for one call: the recipe's first stage.

The same sequence of steps serves both backends; each step runs as a Triton kernel or as its
PyTorch twin. A call launches one statistics pass per tensor that needs one and one quantization
pass per tensor; the balancing factors and FP8 scales are computed inside the quantization passes.
"""

from __future__ import annotations

import torch

from .quantized import LOG2E, QuantizedFP4, QuantizedQKV
from .recipes import Recipe
from .reference import attention as ref_attn
from .reference import quant as ref_quant
from .reference import quant_fp4 as ref_quant_fp4


def _ops(backend: str):
    if backend == "triton":
        from .kernels import quantize as kq

        return kq, kq, kq
    return ref_quant, ref_quant, ref_attn


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: Recipe,
    softmax_scale: float,
    *,
    need_lse_shift: bool,
    backend: str,
    seqs_q=None,
    seqs_k=None,
) -> QuantizedQKV:
    """Q, K, V (logical ``[B, H, N, D]`` views, or packed ``[total, H, D]`` with ``seqs_*`` on the
    Triton backend) → :class:`QuantizedQKV`."""
    stats, quant, extra = _ops(backend)
    kw_q = {"seqs": seqs_q} if backend == "triton" else {}
    kw_k = {"seqs": seqs_k} if backend == "triton" else {}

    k_mean = k_amax = q_mean = q_amax = None
    if recipe.smooth_k or recipe.balance_qk:
        k_mean, k_amax = stats.channel_stats(k, center="mean" if recipe.smooth_k else "none", **kw_k)
    if recipe.smooth_q or recipe.balance_qk:
        q_mean, q_amax = stats.channel_stats(
            q, center="block_mean" if recipe.smooth_q else "none", block=recipe.block_q, **kw_q
        )
    balance = (q_amax, k_amax) if recipe.balance_qk else None
    q8, q_scale = quant.quantize_int8(
        q, granularity=recipe.granularity, block=recipe.block_q, center=q_mean,
        center_per_block=True, balance=balance, balance_role="q",
        scale_multiplier=softmax_scale * LOG2E, **kw_q,
    )
    k8, k_scale = quant.quantize_int8(
        k, granularity=recipe.granularity, block=recipe.block_k, center=k_mean,
        balance=balance, balance_role="k", **kw_k,
    )

    v_mean = v_amax = None
    if recipe.pv == "fp8" or recipe.smooth_v:
        v_mean, v_amax = stats.channel_stats(v, center="mean" if recipe.smooth_v else "none", **kw_k)
    vq, v_scale = quant.convert_v(v, pv=recipe.pv, center=v_mean, amax=v_amax, **kw_k)

    delta = shift = None
    if recipe.smooth_q:
        kw_ds = {"block_q": recipe.block_q, "seqs_q": seqs_q, **kw_k} if backend == "triton" else {}
        delta = extra.delta_s(q_mean, k, k_mean, softmax_scale * LOG2E, **kw_ds)
    if need_lse_shift and k_mean is not None:
        shift = extra.lse_shift(q, k_mean, softmax_scale, **kw_q)
    return QuantizedQKV(
        q=q8, q_scale=q_scale, k=k8, k_scale=k_scale, v=vq, v_scale=v_scale, v_mean=v_mean,
        delta_s=delta, lse_shift=shift,
    )


def quantize_qkv_fp4(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: Recipe,
    softmax_scale: float,
    *,
    need_lse_shift: bool,
    backend: str,
) -> QuantizedFP4:
    """Dense Q, K, V (logical ``[B, H, N, D]`` views) → :class:`QuantizedFP4` for an FP4 recipe.

    NVFP4's per-(batch, head) tensor scales come from the per-channel amax of the smoothed tensor,
    so each tensor that is quantized to NVFP4 gets a statistics pass even without smoothing.
    """
    stats, _, extra = _ops(backend)
    if backend == "triton":
        from .kernels import quantize_fp4 as fp4
    else:
        fp4 = ref_quant_fp4
    fmt = recipe.qk
    nv = fmt == "nvfp4"

    k_mean = k_amax = q_mean = q_amax = v_mean = v_amax = None
    if recipe.smooth_k or nv:
        k_mean, k_amax = stats.channel_stats(k, center="mean" if recipe.smooth_k else "none")
    if recipe.smooth_q or nv:
        q_mean, q_amax = stats.channel_stats(
            q, center="block_mean" if recipe.smooth_q else "none", block=recipe.block_q
        )
    if recipe.smooth_v or nv:
        v_mean, v_amax = stats.channel_stats(v, center="mean" if recipe.smooth_v else "none")
    q4, q_scale, q_global = fp4.quantize_qk_fp4(
        q, fmt, center=q_mean, center_per_block=True, block=recipe.block_q, amax=q_amax
    )
    k4, k_scale, k_global = fp4.quantize_qk_fp4(k, fmt, center=k_mean, amax=k_amax)
    v4, v_scale, v_global = fp4.quantize_v_fp4(
        v, fmt, block_k=recipe.block_k, center=v_mean, amax=v_amax
    )
    multiplier = softmax_scale * LOG2E
    delta = shift = None
    if recipe.smooth_q:
        kw_ds = {"block_q": recipe.block_q} if backend == "triton" else {}
        delta = extra.delta_s(q_mean, k, k_mean, multiplier, **kw_ds)
    if need_lse_shift and k_mean is not None:
        shift = extra.lse_shift(q, k_mean, softmax_scale)
    return QuantizedFP4(
        fmt=fmt, q=q4, q_scale=q_scale, k=k4, k_scale=k_scale, v=v4, v_scale=v_scale,
        qk_multiplier=multiplier, q_global=q_global, k_global=k_global, v_global=v_global,
        v_mean=v_mean if recipe.smooth_v else None, delta_s=delta, lse_shift=shift,
    )
