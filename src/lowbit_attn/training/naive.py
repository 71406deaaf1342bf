"""Trainable attention's numerics (SageBwd) in plain PyTorch: the forward and the backward that the
Triton kernels compute, to rounding, for any combination of INT8 and 16-bit matmuls.

Forward: scores from INT8 (or 16-bit) Q·Kᵀ; an online softmax in base 2 over key blocks of 64; P̃ of
each block quantized per query row as ``round(127·exp2(S - rowmax_block))`` with the row's scale
``exp2(rowmax_block - m)/127``; P̃·V in INT8 against V's per-block scale. The LSE (base 2) is saved.

Backward: S and P recomputed from the LSE; ``dP = dO·Vᵀ``; ``dS = P ∘ (dP - Δ)`` with
``Δ_i = Σ_j P_ij·dP_ij`` from the same P and dP, so each row of dS sums to zero up to fp32 rounding
(``rowsum(dO ∘ O)`` would take the forward's INT8 P̃·V: on nearly one-hot rows a bias the size of
the gradient); P and dS quantized to INT8 per 64×64 tile, or per row of each product's output in
the tile, for ``dV = Pᵀ·dO``, ``dQ = dS·K`` and ``dK = dSᵀ·Q``, each product summed tile by tile
in the kernels' order. K smoothing needs no correction (the rows of dS sum to zero) but under a
softcap: the tanh takes the true scores (each row's shift added back) and dQ gets ``Σ_j
dS_ij·mean K``; Q smoothing adds ``Σ_i dS_ij·mean(Q_block(i))`` to dK.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import (
    INT8_MAX, LOG2E, TILE_AMAX_FLOOR, TRAIN_BLOCK, GradOperands, TrainOperands,
)
from lowbit_attn.core.variants import PLAIN, Variant, softcap_base2
from lowbit_attn.inference.naive import expand_heads, visible_for
from lowbit_attn.quant.int8_naive import nonfinite_guard


def compute_dtype(ops: TrainOperands) -> torch.dtype:
    return torch.float64 if ops.dtype == torch.float64 else torch.float32


def _per_row(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block scales ``[..., nb]`` → per token ``[..., n]``."""
    return scale.repeat_interleave(TRAIN_BLOCK, dim=-1)[..., :n]


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An operand in ``dtype``: INT8 values times their block's scale, or the 16-bit values."""
    return x.to(dtype) * _per_row(scale, x.shape[-2]).to(dtype).unsqueeze(-1)


def scores(ops: TrainOperands, causal_offset: int | None,
           variant: Variant = PLAIN) -> torch.Tensor:
    """Base-2 scores ``[B, Hq, Nq, Nk]`` (soft-capped with ``variant.softcap``, of the true scores
    where K was smoothed: ``ops.row_shift``), ``-inf`` where a key is not visible."""
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
    if variant.softcap:
        s = softcap_base2(s, variant.softcap, _shift(ops, cdt))
    mask = visible_for(variant, nq, nk, causal_offset, ops.q.device)
    return s.masked_fill(~mask, float("-inf"))


def _shift(ops: TrainOperands, dtype) -> torch.Tensor | float:
    """Each row's K-smoothing shift ``[B, Hq, Nq, 1]`` (base 2), or 0."""
    return 0.0 if ops.row_shift is None else ops.row_shift.to(dtype).unsqueeze(-1)


def softcap_slope(s: torch.Tensor, softcap: float, shift: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``1 - tanh²`` of soft-capped base-2 scores ``s`` lowered by ``shift`` (``tanh = (s +
    shift)/(c·log2 e)``; 1 where masked), what dS is multiplied by (``kernel_bwd._tile_p_dp``)."""
    t = (s + shift) * _inv_cap2(softcap, s.dtype)
    return torch.where(torch.isneginf(s), 1.0, 1.0 - t * t)


def _inv_cap2(softcap: float, dtype) -> torch.Tensor:
    """``1/(c·log2 e)``: of the fp32 constant the kernels get, or in float64 for float64 scores."""
    from lowbit_attn.core.variants import cap_args

    if dtype == torch.float64:
        return torch.tensor(1.0 / (softcap * LOG2E), dtype=torch.float64)
    return torch.tensor(1.0 / cap_args(softcap)[0], dtype=torch.float32)


def quantize_p_rows(p: torch.Tensor, int8: bool, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """P̃ of one key block, ``exp2(S - rowmax_block) ∈ [0, 1]``, as the P·V operand and its unit:
    INT8 ``round(127·p)`` with unit 1/127, or ``p`` rounded to the 16-bit dtype with unit 1."""
    if int8:
        return torch.round(p * INT8_MAX), 1.0 / INT8_MAX
    return p.to(dtype).to(p.dtype), 1.0


def forward(ops: TrainOperands, *, causal_offset: int | None,
            variant: Variant = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in fp32 (fp64 for fp64 inputs); the LSE in
    base 2 of the scores (with K smoothing, of the smoothed scores), ``-inf`` for rows that see no
    key (their output is 0)."""
    cdt = compute_dtype(ops)
    b, hq, nq, _ = ops.q.shape
    nk = ops.k.shape[2]
    s_all = scores(ops, causal_offset, variant)
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


def quantize_tiles(x: torch.Tensor, int8: bool, dtype: torch.dtype, granularity: str = "per_tile",
                   contract: str = "query") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., Nq, Nk]`` (P or dS) as the operand of a product over queries (``contract="query"``:
    ``dV = Pᵀ·dO``, ``dK = dSᵀ·Q``) or over keys (``"key"``: ``dQ = dS·K``), in 64×64 tiles.

    Returns ``(values, scales)``: ``values [..., Nq, Nk]`` and the scale of each row of the
    product's output in each tile, ``[..., Nq/64, Nk]`` (per key, for each query block) for
    ``"query"``, ``[..., Nq, Nk/64]`` (per query, for each key block) for ``"key"``; ``x``'s tile
    is ``values·scale`` (partial tiles: the first rows and columns of one). INT8: ``granularity``
    ``"per_tile"``, one scale ``max(amax, 2^-100)/127`` per tile (NaN/Inf poison it; the same for
    every row), or ``"per_row"``, one scale per row of the output (the amax over the contracted
    dimension, NaN propagating); each value the exact product ``x·(1/scale)`` rounded half to
    even (as one fused multiply-add rounds it). 16-bit: ``x`` rounded to ``dtype``, scales of
    1."""
    t = TRAIN_BLOCK
    *lead, nq, nk = x.shape
    nbq, nbk = -(-nq // t), -(-nk // t)
    if not int8:
        shape = (*lead, nbq, nk) if contract == "query" else (*lead, nq, nbk)
        return x.to(dtype).to(x.dtype), torch.ones(shape, dtype=x.dtype, device=x.device)
    padded = torch.nn.functional.pad(x, (0, nbk * t - nk, 0, nbq * t - nq))
    tiles = padded.reshape(*lead, nbq, t, nbk, t)
    if granularity == "per_tile":
        guard = nonfinite_guard(tiles, (-3, -1)).unsqueeze(-1).unsqueeze(-3)
        amax = tiles.abs().amax(dim=(-3, -1), keepdim=True) + guard
    else:  # the output's rows: keys (reduced over a block's queries) or queries (over keys)
        amax = tiles.abs().amax(dim=-3 if contract == "query" else -1, keepdim=True)
    amax = torch.where(amax < TILE_AMAX_FLOOR, TILE_AMAX_FLOOR, amax)  # NaN stays NaN
    scale = amax * (1.0 / INT8_MAX)
    inverse = 1.0 / scale
    values = torch.round(tiles.double() * inverse.double()).to(x.dtype)
    values = torch.nan_to_num(torch.clamp(values, -INT8_MAX, INT8_MAX), nan=0.0)
    values = values.reshape(*lead, nbq * t, nbk * t)[..., :nq, :nk]
    scale = scale.expand(*lead, nbq, t, nbk, t)
    if contract == "query":  # [..., nbq, Nk]: one query of each block
        scales = scale[..., 0, :, :].reshape(*lead, nbq, nbk * t)[..., :nk]
    else:  # [..., Nq, nbk]: one key of each block
        scales = scale[..., 0].reshape(*lead, nbq * t, nbk)[..., :nq, :]
    return values, scales.contiguous()


def _delta(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """``Δ_i = Σ_j P_ij·dP_ij`` as the kernels sum it: each block of 64 keys' row sum, added in key
    order."""
    delta = torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)
    for start in range(0, p.shape[-1], TRAIN_BLOCK):
        cols = slice(start, start + TRAIN_BLOCK)
        delta = delta + (p[..., cols] * dp[..., cols]).sum(dim=-1)
    return delta


def probabilities(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, *,
                  causal_offset: int | None,
                  variant: Variant = PLAIN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P, dP, dS)`` ``[B, Hq, Nq, Nk]`` in the compute dtype, before any tile quantization: P
    from the recomputed scores and the forward's base-2 LSE, ``dP = dO·Vᵀ``, ``dS = P ∘ (dP - Δ)``
    with ``Δ_i = Σ_j P_ij·dP_ij`` (:func:`_delta`; so ``Σ_j dS_ij = Δ_i·(1 - Σ_j P_ij)``: zero up
    to rounding). With a softcap dS is that of the raw scores: times :func:`softcap_slope`."""
    cdt = compute_dtype(ops)
    s = scores(ops, causal_offset, variant)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse).to(cdt)
    p = torch.exp2(s - lse_safe.unsqueeze(-1))
    do_dp = dequantize(grad.do_dp, grad.do_dp_scale, cdt)
    v_dp = expand_heads(dequantize(ops.v_dp, ops.v_dp_scale, cdt), ops.q.shape[1])
    dp = torch.matmul(do_dp, v_dp.transpose(-1, -2))
    ds = p * (dp - _delta(p, dp).unsqueeze(-1))
    if variant.softcap:
        ds = ds * softcap_slope(s, variant.softcap, _shift(ops, cdt))
    return p, dp, ds


def _by_group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, ...]`` → ``[B, Hkv, G, ...]``: query head ``hk·G + g`` at ``[:, hk, g]``."""
    return x.view(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:])


def _over_queries(values: torch.Tensor, scales: torch.Tensor, b: torch.Tensor,
                  b_scale: torch.Tensor, hkv: int, extra=None) -> torch.Tensor:
    """``Σ_i Xᵀ_ji·B_i`` ``[B, Hkv, Nk, D]`` for X = P or dS (:func:`quantize_tiles`' ``values``
    and ``scales`` with ``contract="query"``, ``[B, Hq, Nq, Nk]``) and ``b`` dO or Q
    (``[B, Hq, Nq, D]`` values, ``b_scale`` ``[B, Hq, Nq/64]``), summed as the dK/dV kernels sum it:
    for each query head of the K/V head, then each block of 64 queries, the block's product times
    its scales added into fp32. ``extra(g, rows)``: a term added after each block's product."""
    t = TRAIN_BLOCK
    xs, ss, bs, bss = (_by_group(y, hkv) for y in (values, scales, b.to(values.dtype),
                                                 b_scale.to(values.dtype)))
    out = torch.zeros((values.shape[0], hkv, values.shape[-1], b.shape[-1]), dtype=values.dtype,
                      device=values.device)
    for g in range(xs.shape[2]):
        for j, start in enumerate(range(0, values.shape[-2], t)):
            rows = slice(start, start + t)
            r = torch.matmul(xs[:, :, g, rows].transpose(-1, -2), bs[:, :, g, rows])
            out = out + r * (ss[:, :, g, j, :, None] * bss[:, :, g, j, None, None])
            if extra is not None:
                out = out + extra(g, j, rows)
    return out


def _over_keys(values: torch.Tensor, scales: torch.Tensor, b: torch.Tensor,
               b_scale: torch.Tensor) -> torch.Tensor:
    """``Σ_j X_ij·B_j`` ``[B, Hq, Nq, D]`` for X = dS (``contract="key"``, ``[B, Hq, Nq, Nk]``)
    and ``b`` K expanded to the query heads (``[B, Hq, Nk, D]``, ``b_scale`` ``[B, Hq, Nk/64]``),
    summed as the dQ kernel sums it: each block of 64 keys' product times its scales added into
    fp32, in key order."""
    t = TRAIN_BLOCK
    b, b_scale = b.to(values.dtype), b_scale.to(values.dtype)
    out = torch.zeros((*values.shape[:-1], b.shape[-1]), dtype=values.dtype, device=values.device)
    for j, start in enumerate(range(0, values.shape[-1], t)):
        cols = slice(start, start + t)
        r = torch.matmul(values[..., cols], b[..., cols, :])
        out = out + r * (scales[..., j, None] * b_scale[..., j, None, None])
    return out


def backward(
    ops: TrainOperands,
    grad: GradOperands,
    lse: torch.Tensor,
    *,
    causal_offset: int | None,
    softmax_scale: float,
    variant: Variant = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [B, Hq, Nq, D], dk, dv [B, Hkv, Nk, D])`` in the compute dtype, for the
    forward's base-2 LSE ``lse``; P and dS quantized per tile or per row
    (``ops.backward_granularity``, :func:`quantize_tiles`). Each product is summed tile by tile
    in the kernels' order."""
    cdt = compute_dtype(ops)
    granularity = ops.backward_granularity
    hq, hkv = ops.q.shape[1], ops.k.shape[1]
    p, _, ds = probabilities(ops, grad, lse, causal_offset=causal_offset, variant=variant)

    p_vals, p_scales = quantize_tiles(p, "dv" in ops.int8, ops.dtype, granularity, "query")
    dv = _over_queries(p_vals, p_scales, grad.do_dv, grad.do_dv_scale, hkv)

    ds_vals, ds_scales = quantize_tiles(ds, "dq" in ops.int8, ops.dtype, granularity, "key")
    dq = _over_keys(ds_vals, ds_scales, expand_heads(ops.k_dq, hq),
                    expand_heads(ops.k_dq_scale, hq)) * softmax_scale
    if ops.balance is not None:  # Q entered as Q∘α
        dq = dq * expand_heads(ops.balance.to(cdt).unsqueeze(-2), hq)
    if ops.k_mean is not None:  # K smoothed under a softcap: Σ_j dS_ij·mean K, rows in key order
        rows = _delta(ds, torch.ones_like(ds))
        dq = dq + (rows * softmax_scale).unsqueeze(-1) * expand_heads(
            ops.k_mean.to(cdt), hq).unsqueeze(-2)

    extra = None
    if ops.q_mean is not None:  # dK's Q-smoothing correction, Σ_i dS_ij·mean(Q_block(i))
        ds_g, qm_g = _by_group(ds, hkv), _by_group(ops.q_mean.to(cdt), hkv)

        def extra(g, j, rows):
            return ds_g[:, :, g, rows].sum(dim=-2)[..., :, None] * qm_g[:, :, g, j, None, :]

    ds_vals, ds_scales = quantize_tiles(ds, "dk" in ops.int8, ops.dtype, granularity, "query")
    dk = _over_queries(ds_vals, ds_scales, ops.q_dk, ops.q_dk_scale, hkv, extra) * softmax_scale
    if ops.balance is not None:  # K entered as K/α
        dk = dk / ops.balance.to(cdt).unsqueeze(-2)
    return dq, dk, dv
