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
        v: fp16 values (fp16 P·V) or E4M3 values (fp8 P·V).
        v_scale: fp32 per-channel scales of V ``[B, Hkv, D]`` (fp8 only).
        v_mean: fp32 per-channel mean of V that was subtracted ``[B, Hkv, D]`` (``smooth_v`` only).
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


@dataclass(frozen=True)
class Seqs:
    """Where each sequence's tokens are: dense ``[B, H, N, D]`` (``cu_seqlens`` None), or packed
    ``[total, H, D]`` with sequence ``b`` at rows ``bounds[b]:bounds[b + 1]``."""

    batch: int
    max_len: int
    cu_seqlens: torch.Tensor | None = None
    bounds: tuple[int, ...] = ()

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def dense_seqs(x: torch.Tensor) -> Seqs:
    return Seqs(batch=x.shape[0], max_len=x.shape[2])
