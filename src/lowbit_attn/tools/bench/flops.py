"""Operation and byte counts of one attention call, and the TOP/s they give."""

from __future__ import annotations

from lowbit_attn.core.recipes import Recipe


def attention_ops(batch: int, heads: int, n: int, d: int, causal: bool) -> float:
    """Operations of one attention forward by the protocol: ``4·B·H·N²·D``, halved when causal."""
    ops = 4.0 * batch * heads * n * n * d
    return ops / 2 if causal else ops


def tops(batch: int, heads: int, n: int, d: int, causal: bool, time_ms: float) -> float:
    """TOP/s (10¹² operations per second) of one forward that took ``time_ms`` milliseconds."""
    return attention_ops(batch, heads, n, d, causal) / (time_ms * 1e-3) / 1e12


def quantization_bytes(
    recipe: Recipe, elems_q: int, elems_kv: int, in_bytes: int = 2,
) -> int | None:
    """HBM bytes the quantization passes of ``prepare.quantize_qkv`` move, counted from its code.

    Passes: channel statistics of K (smoothing / balancing), of Q (balancing) and of V (FP8 scale),
    each reading its tensor (one launch for all three); INT8 quantization of K and V's conversion
    (one launch: read in_bytes, write 1 byte per element, or 2 for fp16 V); INT8 quantization of
    Q. The ``[B, H, D]``
    statistics are negligible. ``None`` with Q smoothing (its ΔS pass is not modelled).
    """
    if recipe.is_exact or recipe.smooth_q:
        return None
    total = 0
    if recipe.smooth_k or recipe.balance_qk:
        total += in_bytes * elems_kv
    if recipe.balance_qk:
        total += in_bytes * elems_q
    total += (in_bytes + 1) * elems_kv
    total += (in_bytes + 1) * elems_q
    if recipe.pv == "fp8" or recipe.smooth_v:
        total += in_bytes * elems_kv
    total += (in_bytes + (1 if recipe.pv == "fp8" else 2)) * elems_kv
    return total


def attention_bytes(recipe: Recipe, elems_q: int, elems_kv: int, out_bytes: int = 2) -> int:
    """HBM bytes of the attention kernel when K/V tiles are reused from L2: read INT8 Q and K, V
    (1 byte FP8 or 2 bytes fp16) once, write O."""
    return (elems_q + elems_kv + (1 if recipe.pv == "fp8" else 2) * elems_kv
            + out_bytes * elems_q)
