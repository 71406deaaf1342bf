"""Smoothing, balancing and quantization of Q, K, V for one call: the recipe's first stage.

The same sequence of steps serves both backends; each step runs as a Triton kernel or as its
PyTorch twin. On the Triton backend a call launches one statistics pass for the tensors that need
statistics (:func:`stats_requests`), and quantizes Q and K and converts V in one more
(:func:`quant_args`). The balancing factors and FP8 scales are computed inside the kernels that
use them.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import (
    LOG2E, THREAD_K_BLOCK, QuantizedFP4, QuantizedQKV,
)
from lowbit_attn.core.recipes import Recipe
from lowbit_attn.inference import naive as ref_attn
from lowbit_attn.quant import int8_naive as ref_quant
from lowbit_attn.quant import fp4_qkv_naive as ref_quant_fp4


def _quantizers(backend: str):
    """The modules that quantize for ``backend`` (which the op chose): ``(int8, extra, fp4)``:
    channel statistics and INT8/V quantizers, ΔS and the LSE shift, FP4 operands. The Triton
    launchers fuse what their twins do in separate calls, hence the branches below."""
    if backend == "triton":
        from lowbit_attn.quant import fp4_qkv, int8

        return int8, int8, fp4_qkv
    return ref_quant, ref_attn, ref_quant_fp4


def _stats_all(backend: str, requests: dict[str, tuple], seqs: dict[str, object]) -> dict:
    """``{name: (mean, amax)}`` for ``{name: (x, center, block)}``: one launch on the Triton
    backend."""
    if not requests:
        return {}
    names = list(requests)
    quant, _, _ = _quantizers(backend)
    if backend == "triton":
        found = quant.channel_stats_many(
            *(quant.StatsRequest(*requests[n], seqs=seqs[n]) for n in names)
        )
    else:
        found = [quant.channel_stats(x, center=c, block=blk) for x, c, blk in requests.values()]
    return dict(zip(names, found))


def stats_requests(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe) -> dict:
    """``{name: (tensor, center, block)}`` of the tensors whose channel statistics ``recipe`` needs
    (``"q"``, ``"k"``, ``"v"``): K's mean and amax to smooth and balance it, Q's amax to balance
    (and its block means to smooth it), V's amax for a scale (FP8 always; fp16 when V comes from
    another dtype, whose values can be tiny or past 65504, or is centered)."""
    requests = {}
    if recipe.smooth_k or recipe.balance_qk:
        requests["k"] = (k, "mean" if recipe.smooth_k else "none", 0)
    if recipe.smooth_q or recipe.balance_qk:
        requests["q"] = (q, "block_mean" if recipe.smooth_q else "none", recipe.block_q)
    if recipe.pv == "fp8" or recipe.smooth_v or v.dtype != torch.float16:
        requests["v"] = (v, "mean" if recipe.smooth_v else "none", 0)
    return requests


def quant_args(recipe: Recipe, softmax_scale: float, stats: dict, *, permute_v: bool = False
               ) -> tuple[dict, dict, dict]:
    """Keyword arguments of K's and Q's INT8 quantization and of V's conversion
    (``quantize_int8`` and ``convert_v`` of either backend, and the Triton launch's
    ``Int8Request`` and ``VRequest``), from ``stats`` (``{name: (mean, amax)}`` of
    :func:`stats_requests`' tensors)."""
    k_mean, k_amax = stats.get("k", (None, None))
    q_mean, q_amax = stats.get("q", (None, None))
    v_mean, v_amax = stats.get("v", (None, None))
    balance = (q_amax, k_amax) if recipe.balance_qk else None
    # K's per-thread groups lie in 128-key blocks: its quantization tiles are those blocks
    k_block = THREAD_K_BLOCK if recipe.granularity == "per_thread" else recipe.block_k
    k_args = dict(granularity=recipe.granularity, block=k_block, center=k_mean,
                  balance=balance, role="k")
    q_args = dict(granularity=recipe.granularity, block=recipe.block_q, center=q_mean,
                  center_per_block=True, balance=balance, role="q",
                  scale_multiplier=softmax_scale * LOG2E)
    v_args = dict(pv=recipe.pv, center=v_mean, amax=v_amax, permuted=permute_v)
    return k_args, q_args, v_args


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
    permute_v: bool = False,
) -> QuantizedQKV:
    """Q, K, V (logical ``[B, H, N, D]`` views, or packed ``[total, H, D]`` with ``seqs_*`` on the
    Triton backend) → :class:`QuantizedQKV`.

    On the Triton backend the statistics of all three tensors take one launch and the quantization
    of Q and K with V's conversion another. ``permute_v`` (FP8 P·V, dense; both backends): V's
    keys stored as ``QuantizedQKV.v_permuted`` says."""
    quant, extra, _ = _quantizers(backend)
    triton_backend = backend == "triton"
    kw_q = {"seqs": seqs_q} if triton_backend else {}
    kw_k = {"seqs": seqs_k} if triton_backend else {}
    stats = _stats_all(backend, stats_requests(q, k, v, recipe),
                       {"q": seqs_q, "k": seqs_k, "v": seqs_k})
    k_args, q_args, v_args = quant_args(recipe, softmax_scale, stats, permute_v=permute_v)
    if triton_backend:  # Q joins K's and V's launch
        (k8, k_scale), (vq, v_scale), (q8, q_scale) = quant.quantize(
            quant.Int8Request(k, **k_args),
            quant.VRequest(v, **v_args),
            seqs=seqs_k, q=quant.Int8Request(q, **q_args), seqs_q=seqs_q,
        )
    else:
        k8, k_scale = quant.quantize_int8(k, **k_args)
        vq, v_scale = quant.convert_v(v, **v_args)
        q8, q_scale = quant.quantize_int8(q, **q_args)
    q_mean, k_mean, v_mean = q_args["center"], k_args["center"], v_args["center"]
    multiplier = softmax_scale * LOG2E

    delta = shift = None
    if recipe.smooth_q:
        kw_ds = {"block_q": recipe.block_q, "seqs_q": seqs_q, **kw_k} if triton_backend else {}
        delta = extra.delta_s(q_mean, k, k_mean, multiplier, **kw_ds)
    if need_lse_shift and k_mean is not None:
        shift = extra.lse_shift(q, k_mean, softmax_scale, **kw_q)
    return QuantizedQKV(
        q=q8, q_scale=q_scale, k=k8, k_scale=k_scale, v=vq, v_scale=v_scale, v_mean=v_mean,
        delta_s=delta, lse_shift=shift,
        v_permuted=permute_v,
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
    stats, extra, fp4 = _quantizers(backend)
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
