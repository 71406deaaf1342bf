"""Trainable attention's numerics (SageBwd) in plain PyTorch: the forward and the backward that the
Triton kernels compute, to rounding, for any combination of INT8 and 16-bit matmuls.

Forward: scores from INT8 (or 16-bit) Q·Kᵀ; an online softmax in base 2 over key blocks of 64; P̃ of
each block quantized per query row as ``round(127·exp2(S - rowmax_block))`` with the row's scale
``exp2(rowmax_block - m)/127``; P̃·V in INT8 against V's per-block scale. The LSE (base 2) is saved.

Backward: S and P recomputed from the LSE; ``dP = dO·Vᵀ``; ``dS = P ∘ (dP - Δ)`` with
``Δ_i = Σ_j P_ij·dP_ij`` from the same P and dP, so each row of dS sums to zero up to fp32 rounding
(``rowsum(dO ∘ O)`` would take the forward's INT8 P̃·V: on nearly one-hot rows a bias the size of
the gradient); P and dS quantized per 64×64 tile for ``dV = Pᵀ·dO``, ``dQ = dS·K`` and
``dK = dSᵀ·Q``. K smoothing needs no correction (the rows of dS sum to zero); Q smoothing adds
``Σ_i dS_ij·mean(Q_block(i))`` to dK.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import (
    INT8_MAX, TILE_AMAX_FLOOR, TRAIN_BLOCK, GradOperands, TrainOperands,
)
from lowbit_attn.inference.naive import expand_heads, visible
from lowbit_attn.quant.int8_naive import nonfinite_guard


def compute_dtype(ops: TrainOperands) -> torch.dtype:
    return torch.float64 if ops.dtype == torch.float64 else torch.float32


def _per_row(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block scales ``[..., nb]`` → per token ``[..., n]``."""
    return scale.repeat_interleave(TRAIN_BLOCK, dim=-1)[..., :n]


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An operand in ``dtype``: INT8 values times their block's scale, or the 16-bit values."""
    return x.to(dtype) * _per_row(scale, x.shape[-2]).to(dtype).unsqueeze(-1)


def scores(ops: TrainOperands, causal_offset: int | None) -> torch.Tensor:
    """Base-2 scores ``[B, Hq, Nq, Nk]``, ``-inf`` where a key is not visible."""
    cdt = compute_dtype(ops)
    hq, nq, nk = ops.q.shape[1], ops.q.shape[2], ops.k.shape[2]
    kf = expand_heads(ops.k, hq).to(cdt)
    # INT8 products summed in fp32 are exact (|sum| <= 127²·D < 2^24), as the int32 MMA's.
    s = torch.matmul(ops.q.to(cdt), kf.transpose(-1, -2))
    qs = (ops.q_scale.to(cdt) * ops.qk_multiplier)
    ks = expand_heads(ops.k_scale, hq).to(cdt)
    s = s * (_per_row(qs, nq)[..., :, None] * _per_row(ks, nk)[..., None, :])
    if ops.delta_s is not None:
        s = s + _per_row(ops.delta_s.transpose(-1, -2), nq).transpose(-1, -2).to(cdt)
    mask = visible(nq, nk, causal_offset, ops.q.device)
    return s.masked_fill(~mask, float("-inf"))


def quantize_p_rows(p: torch.Tensor, int8: bool, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """P̃ of one key block, ``exp2(S - rowmax_block) ∈ [0, 1]``, as the P·V operand and its unit:
    INT8 ``round(127·p)`` with unit 1/127, or ``p`` rounded to the 16-bit dtype with unit 1."""
    if int8:
        return torch.round(p * INT8_MAX), 1.0 / INT8_MAX
    return p.to(dtype).to(p.dtype), 1.0


def forward(ops: TrainOperands, *, causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in fp32 (fp64 for fp64 inputs); the LSE in
    base 2 of the scores (with K smoothing, of the smoothed scores), ``-inf`` for rows that see no
    key (their output is 0)."""
    cdt = compute_dtype(ops)
    b, hq, nq, _ = ops.q.shape
    nk = ops.k.shape[2]
    s_all = scores(ops, causal_offset)
    vf = expand_heads(ops.v, hq).to(cdt)
    vs = expand_heads(ops.v_scale, hq).to(cdt)
    m = torch.full((b, hq, nq), float("-inf"), dtype=cdt, device=ops.q.device)
    l_sum = torch.zeros((b, hq, nq), dtype=cdt, device=ops.q.device)
    acc = torch.zeros((b, hq, nq, vf.shape[-1]), dtype=cdt, device=ops.q.device)
    for j, start in enumerate(range(0, nk, TRAIN_BLOCK)):
        s = s_all[..., start : start + TRAIN_BLOCK]
        block_max = s.amax(dim=-1)
        m_new = torch.maximum(m, block_max)
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        bmax_safe = torch.where(torch.isneginf(block_max), 0.0, block_max)
        alpha = torch.exp2(m - m_safe)
        row_scale = torch.exp2(block_max - m_safe)
        p = torch.exp2(s - bmax_safe.unsqueeze(-1))
        l_sum = l_sum * alpha + p.sum(dim=-1) * row_scale
        pq, unit = quantize_p_rows(p, "pv" in ops.int8, ops.dtype)
        pv = torch.matmul(pq, vf[..., start : start + TRAIN_BLOCK, :])
        acc = acc * alpha.unsqueeze(-1) + pv * (row_scale * (vs[..., j : j + 1] * unit)).unsqueeze(-1)
        m = m_new
    empty = l_sum == 0
    out = acc / torch.where(empty, 1.0, l_sum).unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    lse = m + torch.log2(l_sum)
    return out, lse


def quantize_tiles(x: torch.Tensor, int8: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[..., Nq, Nk]`` → the same values as a matmul operand, dequantized: INT8 with one scale
    ``max(amax, 2^-100)/127`` per 64×64 tile (NaN/Inf poison their tile's scale), each value
    times the scale's reciprocal, or rounded to ``dtype``."""
    if not int8:
        return x.to(dtype).to(x.dtype)
    *lead, nq, nk = x.shape
    t = TRAIN_BLOCK
    nbq, nbk = -(-nq // t), -(-nk // t)
    padded = torch.nn.functional.pad(x, (0, nbk * t - nk, 0, nbq * t - nq))
    tiles = padded.reshape(*lead, nbq, t, nbk, t)
    guard = nonfinite_guard(tiles, (-3, -1)).unsqueeze(-1).unsqueeze(-3)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True) + guard
    amax = torch.where(amax < TILE_AMAX_FLOOR, TILE_AMAX_FLOOR, amax)  # NaN stays NaN
    scale = amax * (1.0 / INT8_MAX)
    values = torch.clamp(torch.round(tiles * (1.0 / scale)), -INT8_MAX, INT8_MAX)
    values = torch.nan_to_num(values, nan=0.0)
    deq = (values * scale).reshape(*lead, nbq * t, nbk * t)
    return deq[..., :nq, :nk]


def _sum_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, N, D]`` → ``[B, Hkv, N, D]``: the query heads that share a K/V head, summed."""
    b, hq, n, d = x.shape
    return x.view(b, hkv, hq // hkv, n, d).sum(dim=2)


def probabilities(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, *,
                  causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P, dP, dS)`` ``[B, Hq, Nq, Nk]`` in the compute dtype, before any tile quantization: P
    from the recomputed scores and the forward's base-2 LSE, ``dP = dO·Vᵀ``, ``dS = P ∘ (dP - Δ)``
    with ``Δ_i = Σ_j P_ij·dP_ij`` (so ``Σ_j dS_ij = Δ_i·(1 - Σ_j P_ij)``: zero up to rounding)."""
    cdt = compute_dtype(ops)
    s = scores(ops, causal_offset)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse).to(cdt)
    p = torch.exp2(s - lse_safe.unsqueeze(-1))
    do_dp = dequantize(grad.do_dp, grad.do_dp_scale, cdt)
    v_dp = expand_heads(dequantize(ops.v_dp, ops.v_dp_scale, cdt), ops.q.shape[1])
    dp = torch.matmul(do_dp, v_dp.transpose(-1, -2))
    return p, dp, p * (dp - (p * dp).sum(dim=-1, keepdim=True))


def backward(
    ops: TrainOperands,
    grad: GradOperands,
    lse: torch.Tensor,
    *,
    causal_offset: int | None,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [B, Hq, Nq, D], dk, dv [B, Hkv, Nk, D])`` in the compute dtype, for the
    forward's base-2 LSE ``lse``."""
    cdt = compute_dtype(ops)
    hq, hkv = ops.q.shape[1], ops.k.shape[1]
    p, _, ds = probabilities(ops, grad, lse, causal_offset=causal_offset)

    do_dv = dequantize(grad.do_dv, grad.do_dv_scale, cdt)
    p_op = quantize_tiles(p, "dv" in ops.int8, ops.dtype)
    dv = _sum_groups(torch.matmul(p_op.transpose(-1, -2), do_dv), hkv)

    k_dq = expand_heads(dequantize(ops.k_dq, ops.k_dq_scale, cdt), hq)
    dq = torch.matmul(quantize_tiles(ds, "dq" in ops.int8, ops.dtype), k_dq) * softmax_scale

    q_dk = dequantize(ops.q_dk, ops.q_dk_scale, cdt)
    ds_t = quantize_tiles(ds, "dk" in ops.int8, ops.dtype).transpose(-1, -2)
    dk = torch.matmul(ds_t, q_dk)
    if ops.q_mean is not None:
        qm = _per_row(ops.q_mean.transpose(-1, -2), ops.q.shape[2]).transpose(-1, -2).to(cdt)
        dk = dk + torch.matmul(ds.transpose(-1, -2), qm)
    dk = _sum_groups(dk, hkv) * softmax_scale
    if ops.balance is not None:  # Q entered as Q∘α and K as K/α
        alpha = ops.balance.to(cdt).unsqueeze(-2)
        dq = dq * expand_heads(alpha, hq)
        dk = dk / alpha
    return dq, dk, dv
