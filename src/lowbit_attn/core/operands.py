"""The quantized operands of one attention call, as the quantizers hand them to the attention stage.

Both implementations (Triton kernels and the PyTorch reference) produce and consume this container,
which is what lets the tests compare them integer for integer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
INT8_MAX = 127.0
FP8_MAX = 448.0
LOG2_FP8_MAX = 8.807354922057604  # log2(448): P̃·448 is computed as exp2(s - m + log2 448)
# fp16 V: a channel whose amax has a binary exponent in [FP16_V_KEEP_LO, FP16_V_KEEP_HI] is rounded
# as it is (scale 1: the same bits as without scaling); any other is multiplied by the power of two
# (exact) that puts its amax's exponent at FP16_V_KEEP_HI. Below 2^8, no value rounds to Inf (fp16
# holds up to 65504) and P̃·V cannot overflow even if a block of up to 128 keys were summed in fp16
# (P̃ ≤ 1; it is summed in fp32); from 2^-6 on, values down to amax/2^8 are fp16 normals and smaller
# ones err by at most 2^-25 < amax·2^-19, so tiny V is neither flushed nor coarsened. The scales
# (and their inverses) stay within fp32's normal range.
FP16_V_KEEP_LO = -6
FP16_V_KEEP_HI = 7


@dataclass
class QuantizedQKV:
    """Operands for the attention stage.

    Dense calls hold ``[B, H, N, D]`` tensors (V may be a transposed view of a ``[B, H, D, N']``
    buffer); packed (varlen) calls hold ``[total, H, D]`` tensors and ``[H, total]`` per-token vectors.

    Attributes:
        q, k: INT8 values.
        q_scale: fp32 dequantization scales of Q, multiplied by ``softmax_scale·log2(e)`` so that
            ``(q·kᵀ)·q_scale·k_scale`` are scores in base 2. ``[B, Hq, ceil(Nq/block_q)]`` per block,
            ``[B, Hq, Nq]`` per token.
        k_scale: fp32 scales of K, ``[B, Hkv, ceil(Nk/block_k)]`` or ``[B, Hkv, Nk]``.
        v: fp16 values (fp16 P·V) or E4M3 values (fp8 P·V). Packed E4M3 ``v`` is ``[T', H, D]``
            (a view of ``[H, D, T']``, :func:`packed_v_tokens`): sequence ``b``'s keys start at
            token :func:`packed_v_starts` ``[b]``, a multiple of 16, with zeros up to the next
            multiple of 16; the tokens between are never read.
        v_scale: fp32 per-channel scales of V ``[B, Hkv, D]``: V ≈ ``v·v_scale`` (FP8: ``amax/448``;
            fp16: a power of two, see ``reference.quant.fp16_v_scale``; None for fp16 V that is
            neither converted from another dtype nor centered, which fp16 holds exactly).
        v_mean: fp32 per-channel mean of V that was subtracted ``[B, Hkv, D]`` (``smooth_v`` only).
        v_permuted: E4M3 ``v`` holds its keys permuted in groups of 16 (:data:`V_KEY_ORDER`) and
            padded with zeros to ``N' =`` :func:`permuted_v_keys` ``(N)``: ``v`` is then ``[B, H,
            N', D]`` in stored order (a transposed view of ``[B, H, D, N']``). Dense calls only.
        delta_s: fp32 Q-smoothing correction in base-2 score units ``[B, Hq, ceil(Nq/block_q), Nk]``.
        lse_shift: fp32 ``softmax_scale·(q·mean(K))`` per query row, added to the natural-log LSE so
            that it is the LSE of the unsmoothed scores (``smooth_k`` with ``return_lse`` only).
    """

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    delta_s: torch.Tensor | None = None
    lse_shift: torch.Tensor | None = None
    v_permuted: bool = False


@dataclass(frozen=True)
class Seqs:
    """Where each sequence's tokens are: dense ``[B, H, N, D]`` (``cu_seqlens`` None), or packed
    ``[total, H, D]`` with sequence ``b`` at rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, on
    the tensors' device)."""

    batch: int
    max_len: int
    cu_seqlens: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def dense_seqs(x: torch.Tensor) -> Seqs:
    return Seqs(batch=x.shape[0], max_len=x.shape[2])


# Packed E4M3 V (stored token-contiguous, one byte a token) starts each sequence at a multiple of
# 16 tokens, so that a sequence's rows of V are 16-byte aligned and the attention kernel's V tile
# can be an asynchronous copy (cp.async, TMA) rather than a load into registers (benchmarks/
# NOTES.md, "D = 256 configurations"). Sequence b starts at 16·(cu_seqlens[b] // 16 + b): each
# start follows from its own cu_seqlens entry, with no prefix sum and no host sync for the
# buffer's size; ``core.triton_helpers.packed_v_start`` is the kernels' copy of the rule.
PACKED_V_ALIGN = 16


def packed_v_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The first stored token of each packed sequence's E4M3 V (``[B + 1]``, the last entry is
    :func:`packed_v_tokens`): ``16·(cu_seqlens[b] // 16 + b)``. Sequence ``b`` then has at
    least ``cu_seqlens[b + 1] - cu_seqlens[b] + 1`` tokens, rounded up to 16, before the next."""
    b = torch.arange(cu_seqlens.numel(), device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (cu_seqlens // PACKED_V_ALIGN + b) * PACKED_V_ALIGN


def packed_v_tokens(total: int, batch: int) -> int:
    """Tokens of a packed E4M3 V buffer for ``batch`` sequences of ``total`` tokens: 16 per
    sequence more than ``total`` rounded down to 16 (so at most ``16·batch`` of padding)."""
    return (total // PACKED_V_ALIGN + batch) * PACKED_V_ALIGN


# Per-thread INT8 scale groups (``granularity="per_thread"``, SageAttention2's sm90 layout; see
# ``quant.int8_naive.thread_groups``): Q's rows pair up within slices of 16 rows, K's keys form 4
# groups in each block of 128.
THREAD_Q_SLICE = 16
THREAD_K_BLOCK = 128

# E4M3 V for a kernel that feeds P̃ to the FP8 wgmma as its register operand
# (``QuantizedQKV.v_permuted``): in each group of 16 keys, storage position ``i`` holds key
# ``V_KEY_ORDER[i]``. A thread's score columns 2c, 2c+1, 2c+8, 2c+9 (the wgmma accumulator's
# fragment) are then positions 4c..4c+3, which its FP8 A fragment holds: no data moves.
V_KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
# Permuted V stores at least this many keys (zeros past the last), the one-warpgroup Hopper
# forward's key block: its V descriptor, whose box spans a block of keys along the contiguous
# dimension, then never spans more than the tensor. A box wider than the whole tensor is what
# only the one-key case had when it failed on the H200 (2026-11-29): the suspect, unconfirmed.
V_PERMUTED_MIN_KEYS = 128


def permuted_v_keys(n: int) -> int:
    """Keys stored by permuted V for ``n`` keys: ``n`` padded to 16, at least
    :data:`V_PERMUTED_MIN_KEYS`."""
    return max(-(-n // 16) * 16, V_PERMUTED_MIN_KEYS)

FP4_GROUP = {"nvfp4": 16, "mxfp4": 32}  # elements per scale
# Where a two-level P̃ row's block maximum is put before the FP4 group quantization: NVFP4 at 448·6,
# the top of its range (group scale 448, E4M3's largest); MXFP4 at 6, a value its power-of-two
# scales hold exactly (2688 = 5.25·2^9 would come back as 6·2^9, 14% high).
P_TWO_LEVEL_PEAK = {"nvfp4": 2688.0, "mxfp4": 6.0}


def padded_head_dim(d: int) -> int:
    """Channels of a stored FP4 operand: the next power of two, at least 64 (one FP4 MMA's depth)."""
    return max(64, 1 << (d - 1).bit_length())


@dataclass
class QuantizedFP4:
    """Operands for the FP4 attention stage (dense ``[B, H, N, ·]`` tensors).

    Values are E2M1 codes two per byte (low nibble first); scales are bit patterns (uint8): E4M3
    for NVFP4 (groups of 16), E8M0 for MXFP4 (groups of 32). The channel dimension is padded with
    zeros to ``dp`` (a power of two, at least 64) and V's token dimension to a whole number of key
    blocks, so the attention kernel reads whole tiles.

    Attributes:
        fmt: ``"nvfp4"`` or ``"mxfp4"``.
        q, q_scale: ``[B, Hq, Nq, dp/2]`` and ``[B, Hq, Nq, dp/group]`` (groups along channels).
        k, k_scale: ``[B, Hkv, Nk, dp/2]`` and ``[B, Hkv, Nk, dp/group]``.
        v, v_scale: V transposed, ``[B, Hkv, dp, Nk_pad/2]`` and ``[B, Hkv, dp, Nk_pad/group]``
            (groups along tokens: V is the right operand of P·V).
        q_global, k_global, v_global: NVFP4 tensor scales, fp32 ``[B, H]`` per (batch, head);
            ``None`` for MXFP4.
        qk_multiplier: ``softmax_scale·log2 e``: scores in base 2 are the product times it (times
            the tensor scales of Q and K for NVFP4).
        v_mean, delta_s, lse_shift: as in :class:`QuantizedQKV`.
    """

    fmt: str
    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    qk_multiplier: float
    q_global: torch.Tensor | None = None
    k_global: torch.Tensor | None = None
    v_global: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    delta_s: torch.Tensor | None = None
    lse_shift: torch.Tensor | None = None


# Trainable attention (SageBwd): Q, K, V and dO are quantized in blocks of this many tokens, and the
# backward quantizes P and dS in tiles of TRAIN_BLOCK × TRAIN_BLOCK (queries × keys). Every kernel
# tile is aligned to these groups, so a scale never varies along a product's reduction axis.
TRAIN_BLOCK = 64
# The least amax a trainable backward's P or dS tile is quantized against (smaller ones quantize
# with this step): its INT8 step is then a normal fp32 number whose reciprocal is finite, so each
# element is multiplied by the tile's one reciprocal rather than divided by its scale.
TILE_AMAX_FLOOR = 2.0 ** -100
# The seven matmuls of an attention forward and backward: the forward's Q·Kᵀ (recomputed in the
# backward with the same operands), P·V, and the backward's dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K and
# dK = dSᵀ·Q.
TRAIN_MATMULS = ("qk", "pv", "dp", "dv", "dq", "dk")


@dataclass
class TrainOperands:
    """The operands of the trainable attention's matmuls, each either INT8 with one fp32 scale per
    :data:`TRAIN_BLOCK` tokens (``[B, H, ceil(N/64)]``) or in 16-bit (the input dtype) with scales
    of 1. All tensors are dense ``[B, H, N, D]``.

    Attributes:
        q, q_scale: Q (minus its block means with ``smooth_q``) for Q·Kᵀ.
        k, k_scale: K (minus its mean with ``smooth_k``) for Q·Kᵀ.
        v, v_scale: V for P·V.
        k_dq, q_dk, v_dp: the same tensors as they enter dQ = dS·K, dK = dSᵀ·Q and dP = dO·Vᵀ
            (the same objects as ``k``, ``q``, ``v`` when the two matmuls share a format).
        qk_multiplier: ``softmax_scale·log2(e)``: ``(q·kᵀ)·s_q·s_k·qk_multiplier`` are base-2 scores.
        q_mean: fp32 block means of Q ``[B, Hq, ceil(Nq/64), D]`` (``smooth_q``), for dK's
            correction ``Σ_i dS_ij·mean(Q_block(i))`` (times ``balance`` when balancing).
        balance: fp32 ``α`` ``[B, Hkv, D]`` (``balance_qk``): Q's channels enter every product
            times α, K's divided by α; the backward returns ``dQ∘α`` and ``dK/α`` to undo it.
        delta_s: fp32 ``mean(Q_block)·K'ᵀ·qk_multiplier`` ``[B, Hq, ceil(Nq/64), Nk]`` added to the
            scores (``smooth_q``).
        row_shift, k_mean: with a softcap and ``smooth_k``: what K smoothing took off each row of
            scores, fp32 base 2 ``(q·mean K)·qk_multiplier`` ``[B, Hq, Nq]`` (the tanh takes the
            true scores), and K's mean ``[B, Hkv, D]`` fp32 for dQ's correction ``Σ_j dS_ij·mean
            K`` (a softcap's dS rows do not sum to zero).
        int8: the matmuls computed in INT8 (names from :data:`TRAIN_MATMULS`).
        dtype: the inputs' dtype: 16-bit operands (and P, dS of 16-bit matmuls) are rounded to it.
        backward_granularity: the INT8 scale groups of P and dS in the backward
            (``TrainRecipe.backward_granularity``): ``"per_tile"`` or ``"per_row"``.
    """

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    k_dq: torch.Tensor
    k_dq_scale: torch.Tensor
    q_dk: torch.Tensor
    q_dk_scale: torch.Tensor
    v_dp: torch.Tensor
    v_dp_scale: torch.Tensor
    qk_multiplier: float
    int8: frozenset
    dtype: torch.dtype
    q_mean: torch.Tensor | None = None
    delta_s: torch.Tensor | None = None
    balance: torch.Tensor | None = None
    backward_granularity: str = "per_tile"
    row_shift: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None


@dataclass
class GradOperands:
    """dO ``[B, Hq, Nq, D]`` for dV = Pᵀ·dO (``do_dv``) and dP = dO·Vᵀ (``do_dp``), INT8 per 64 rows
    or 16-bit (with scales of 1). The backward computes ``Δ = rowsum(P ∘ dP)`` itself, from the P
    and dP that dS uses."""

    do_dv: torch.Tensor
    do_dv_scale: torch.Tensor
    do_dp: torch.Tensor
    do_dp_scale: torch.Tensor


def token_major(x: torch.Tensor) -> torch.Tensor:
    """``x [..., N, D]`` with its tokens contiguous (a copy unless they are; the same logical
    tensor): the layout in which it is the B operand of a product over tokens (P̃·V, dV = Pᵀ·dO,
    dK = dSᵀ·Q, dQ = dS·K) as an 8-bit wgmma takes it, K-major; in the other layout Triton
    transposes the tile through shared memory a byte at a time."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


INT32_SPAN = 2 ** 31


def addressable(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, N, D]``, or a contiguous copy where one (batch, head)'s elements span 2^31 or
    more (an NHD view with ``H·D = 4096`` at ``N ≥ 524288``): for the training loops, which
    address a block's rows within a head in int32 (64-bit there would cost registers in the
    loop); contiguous, a head spans ``N·D``."""
    n, d = x.shape[-2:]
    if n and d and (n - 1) * abs(x.stride(-2)) + (d - 1) * abs(x.stride(-1)) >= INT32_SPAN:
        return x.contiguous()
    return x
