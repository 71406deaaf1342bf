"""The trainable attention's operands: Q, K, V (and, in the backward, dO) smoothed and quantized per
block of 64 tokens for the matmuls that run in INT8, or kept in the input dtype for the others.

Each tensor is prepared once per format, and the forward and the backward prepare it identically
(same bits), so the backward's recomputed scores are the forward's.
"""

from __future__ import annotations

import functools

import torch

from lowbit_attn.core.operands import LOG2E, TRAIN_BLOCK, GradOperands, TrainOperands
from lowbit_attn.core.recipes import TrainRecipe
from lowbit_attn.core.operands import addressable, token_major
from lowbit_attn.inference import naive as ref_attn
from lowbit_attn.quant import int8_naive as ref_quant


def _quantizers(backend: str):
    """``(int8 module, delta_s, lse_shift)`` of ``backend`` (which the op chose): the channel
    statistics and INT8 quantizers, ``ΔS = mean(Q_block)·(K - mean K)ᵀ·multiplier`` ``[B, Hq, nbq,
    Nk]`` (fp64 for fp64 inputs) as ``delta_s(q_mean, k, k_mean, multiplier)``, and each row's
    ``(q·mean K)·multiplier`` ``[B, Hq, Nq]`` fp32 (fp64 for fp64 inputs) as ``lse_shift(q,
    k_mean, multiplier)``."""
    if backend == "triton":
        from lowbit_attn.quant import int8 as kq

        return kq, functools.partial(kq.delta_s, block_q=TRAIN_BLOCK), kq.lse_shift
    return ref_quant, ref_attn.delta_s, ref_attn.lse_shift


def _centered(x: torch.Tensor, center: torch.Tensor | None, per_block: bool,
              alpha: torch.Tensor | None = None, divide: bool = False) -> torch.Tensor:
    """``(x - center)`` times (or, with ``divide``, over) the per-channel ``alpha`` ``[B, H, D]``,
    in at least fp32 (fp64 for fp64 inputs, so that ``q·α`` and ``k/α`` cancel exactly there),
    rounded back to x's dtype (a 16-bit operand)."""
    if center is None and alpha is None:
        return x
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    if center is not None:
        c = ref_quant.expand_blocks(center, TRAIN_BLOCK, x.shape[-2]) if per_block else center.unsqueeze(-2)
        wide = wide - c.to(wide.dtype)
    if alpha is not None:
        a = alpha.to(wide.dtype).unsqueeze(-2)
        wide = wide / a if divide else wide * a
    return wide.to(x.dtype)


def per_query_head(alpha: torch.Tensor, hq: int) -> torch.Tensor:
    """``[B, Hkv, D]`` → ``[B, Hq, D]``."""
    return alpha.repeat_interleave(hq // alpha.shape[1], dim=1)


def _ones(x: torch.Tensor) -> torch.Tensor:
    b, h, n, _ = x.shape
    return torch.ones((b, h, -(-n // TRAIN_BLOCK)), device=x.device, dtype=torch.float32)


class _Formats:
    """Each of a tensor's formats made at most once: INT8 per block, or 16-bit. ``balance``:
    ``((amax_q, amax_k), role, α of this tensor's heads)`` (Q is multiplied by α, K divided) or
    None."""

    def __init__(self, x, center, per_block, quant, balance=None):
        self.x, self.center, self.per_block, self.quant = x, center, per_block, quant
        self.balance = balance
        self.made: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if int8 not in self.made:
            if int8:
                amaxes, role, _ = self.balance or (None, "q", None)
                self.made[int8] = self.quant.quantize_int8(
                    self.x, granularity="per_block", block=TRAIN_BLOCK, center=self.center,
                    center_per_block=self.per_block, balance=amaxes, role=role,
                )
            else:
                _, role, alpha = self.balance or (None, "q", None)
                self.made[int8] = (
                    addressable(_centered(self.x, self.center, self.per_block, alpha,
                                          divide=role == "k")),
                    _ones(self.x),
                )
        return self.made[int8]


def prepare(q, k, v, recipe: TrainRecipe, softmax_scale: float, backend: str,
            softcap: bool = False) -> TrainOperands:
    """Dense ``[B, H, N, D]`` q, k, v → :class:`TrainOperands`; with ``softcap`` and K smoothed,
    each row's shift and K's mean too (the tanh and dQ need what smoothing took off)."""
    quant, delta_s, lse_shift = _quantizers(backend)
    int8 = recipe.int8
    k_mean = q_mean = q_amax = k_amax = None
    if recipe.smooth_k or recipe.balance_qk:
        k_mean, k_amax = quant.channel_stats(k, center="mean" if recipe.smooth_k else "none")
    if recipe.smooth_q or recipe.balance_qk:
        q_mean, q_amax = quant.channel_stats(
            q, center="block_mean" if recipe.smooth_q else "none", block=TRAIN_BLOCK
        )
    qb = kb = alpha = None
    if recipe.balance_qk:
        alpha = ref_quant.balance_factors(q_amax, k_amax)
        qb = ((q_amax, k_amax), "q", per_query_head(alpha, q.shape[1]))
        kb = ((q_amax, k_amax), "k", alpha)
    qf = _Formats(q, q_mean, True, quant, qb)
    kf = _Formats(k, k_mean, False, quant, kb)
    vf = _Formats(v, None, False, quant)
    multiplier = softmax_scale * LOG2E
    (q_qk, qs), (k_qk, ks) = qf.get("qk" in int8), kf.get("qk" in int8)
    v_pv, vs = vf.get("pv" in int8)
    k_dq, kdqs = kf.get("dq" in int8)
    q_dk, qdks = qf.get("dk" in int8)
    v_dp, vdps = vf.get("dp" in int8)
    delta = row_shift = None
    if recipe.smooth_q:
        delta = delta_s(q_mean, k, k_mean, multiplier)
    if softcap and recipe.smooth_k:
        row_shift = lse_shift(q, k_mean, multiplier)
    if q_mean is not None and alpha is not None:  # dK's correction, in the balanced space of Q
        wide = torch.promote_types(q.dtype, torch.float32)
        q_mean = q_mean.to(wide) * per_query_head(alpha, q.shape[1]).to(wide).unsqueeze(-2)
    return TrainOperands(
        q=q_qk, q_scale=qs, k=k_qk, k_scale=ks, v=v_pv, v_scale=vs, k_dq=k_dq, k_dq_scale=kdqs,
        q_dk=q_dk, q_dk_scale=qdks, v_dp=v_dp, v_dp_scale=vdps, qk_multiplier=multiplier,
        int8=int8, dtype=q.dtype, q_mean=q_mean, delta_s=delta, balance=alpha,
        backward_granularity=recipe.backward_granularity, row_shift=row_shift,
        k_mean=k_mean if row_shift is not None else None,
    )


def prepare_grad(do: torch.Tensor, recipe: TrainRecipe, backend: str) -> GradOperands:
    """dO ``[B, Hq, Nq, D]`` → :class:`GradOperands`."""
    int8 = recipe.int8
    do8 = do_scale = None
    if {"dv", "dp"} & int8:
        quant = _quantizers(backend)[0]
        do8, do_scale = quant.quantize_int8(do, granularity="per_block", block=TRAIN_BLOCK)
    ones = _ones(do)
    do = addressable(do)  # where a 16-bit product reads it
    # dV = Pᵀ·dO's 8-bit wgmma reads dO token-major: made so here, once (unless dP is INT8 too,
    # the original is then no longer held)
    do_dv = (token_major(do8), do_scale) if "dv" in int8 else (do, ones)
    do_dp = (do8, do_scale) if "dp" in int8 else (do, ones)
    return GradOperands(do_dv=do_dv[0], do_dv_scale=do_dv[1], do_dp=do_dp[0], do_dp_scale=do_dp[1])
