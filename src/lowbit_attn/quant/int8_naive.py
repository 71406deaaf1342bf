"""PyTorch twins of the quantization kernels. Given the same statistics, they produce the same bits.

All functions take dense ``[B, H, N, D]`` tensors (a packed sequence is handled one sequence at a
time by the caller). Arithmetic is fp32 and in the kernels' order, so results are bit-identical.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import (
    FP8_MAX, FP16_V_KEEP_HI, FP16_V_KEEP_LO, INT8_MAX, THREAD_K_BLOCK, THREAD_Q_SLICE,
    V_KEY_ORDER, permuted_v_keys,
)


def nonfinite_guard(y: torch.Tensor, dims) -> torch.Tensor:
    """0 where every element of the group is finite, NaN otherwise (``sum(y·0)``): added to an
    ``amax`` it keeps a NaN or Inf from being hidden behind a finite scale."""
    return (y * 0.0).sum(dim=dims)


def channel_stats(
    x: torch.Tensor, *, center: str, block: int = 0
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-channel statistics over tokens.

    Args:
        x: ``[B, H, N, D]``.
        center: ``"none"``, ``"mean"`` (one mean per (batch, head, channel)) or ``"block_mean"``
            (one mean per block of ``block`` consecutive tokens).
    Returns:
        ``(mean, amax)``: ``mean`` is ``None``, ``[B, H, D]`` or ``[B, H, ceil(N/block), D]`` fp32;
        ``amax`` is ``max |x - mean|`` per channel, ``[B, H, D]`` fp32, NaN if any input is not finite.
        No token (``N = 0``, a packed sequence without keys) gives means and amax 0, not 0/0.
    """
    # contiguous: the sums' order (and so their last bit) must not depend on x's strides
    xf = x.float().contiguous()
    n = x.shape[-2]
    if center == "none":
        mean = None
        centered = xf
    elif center == "mean":
        mean = xf.sum(dim=-2) / max(n, 1)
        centered = xf - mean.unsqueeze(-2)
    elif center == "block_mean":
        mean = block_means(xf, block)
        centered = xf - expand_blocks(mean, block, n)
    else:
        raise ValueError(f"center must be 'none', 'mean' or 'block_mean', got {center!r}")
    if n == 0:
        return mean, xf.new_zeros(x.shape[:2] + x.shape[3:])
    amax = centered.abs().amax(dim=-2) + nonfinite_guard(centered, -2)
    return mean, amax


def block_means(xf: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of each block of ``block`` tokens (the last block may be partial): ``[B, H, nb, D]``."""
    b, h, n, d = xf.shape
    nb = -(-n // block)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, nb * block - n))
    sums = padded.reshape(b, h, nb, block, d).sum(dim=3)
    counts = torch.full((nb,), float(block), device=xf.device)
    counts[nb - 1 :] = n - (nb - 1) * block  # the last block (none when n = 0)
    return sums / counts[:, None]


def expand_blocks(per_block: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """``[..., nb, X]`` → ``[..., n, X]``: each block's row repeated for its tokens."""
    return per_block.repeat_interleave(block, dim=-2)[..., :n, :]


# α's range: a ratio of finite maxima can overflow fp32 (bf16 Q ~1e-38 against K ~1e3: α = inf,
# and Q·α NaN) or underflow it (α = 0, K/α NaN); within 2**±32, Q·α and K/α stay finite and the
# ratio's square root is of a normal fp32 number on every device.
ALPHA_MIN, ALPHA_MAX = 2.0**-32, 2.0**32


def balance_factors(amax_q: torch.Tensor, amax_k: torch.Tensor) -> torch.Tensor:
    """``α_c = sqrt(amax|K_c| / amax|Q_c|)`` per (batch, KV head, channel), ``[B, Hkv, D]``,
    within ``[ALPHA_MIN, ALPHA_MAX]``.

    Q's amax is taken over all query heads that share the KV head. A channel where either side is
    all zero keeps ``α = 1``; NaN statistics give NaN (never hidden).
    """
    b, hq, d = amax_q.shape
    hkv = amax_k.shape[1]
    aq = amax_q.view(b, hkv, hq // hkv, d).amax(dim=2)
    alpha = sqrt_rn(amax_k / aq)
    alpha = torch.where(alpha > ALPHA_MAX, ALPHA_MAX, torch.where(alpha < ALPHA_MIN, ALPHA_MIN,
                                                                   alpha))  # NaN stays NaN
    degenerate = (aq == 0) | (amax_k == 0)
    return torch.where(degenerate, torch.ones_like(alpha), alpha)


def div_rn(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded, as the kernels' ``tl.div_rn``: on a GPU, PyTorch divides
    a tensor by a Python number as a multiplication by its reciprocal (one rounding more; seen on
    an H100: 1 in 8 NVFP4 tensor scales one ulp off), by a tensor of the divisor it divides."""
    return x / torch.full_like(x, divisor)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (IEEE ``sqrt``, the kernels' ``tl.sqrt_rn``).

    ``torch.sqrt`` on a CPU is not always correctly rounded: with torch 2.13's CPU build on an AMD
    EPYC, 17 % of fp32 results are one ulp off, under every ``ATEN_CPU_CAPABILITY``. So the root is
    taken in fp64, rounded to fp32, and moved by one ulp where the exact test says so: for an fp32
    ``s`` the midpoints ``m`` to its neighbours have 25 significant bits, so ``m²`` is exact in fp64
    and ``x < m²`` decides the rounding (a tie is impossible: ``m²`` needs more bits than ``x``).
    """
    x = x.float()
    s = torch.sqrt(x.double()).float()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    down = torch.nextafter(s, torch.zeros_like(s))
    sd = s.double()
    mid_up = (sd + up.double()) * 0.5
    mid_down = (sd + down.double()) * 0.5
    xd = x.double()
    regular = torch.isfinite(s) & (s > 0)
    s = torch.where(regular & (xd >= mid_up * mid_up), up, s)
    return torch.where(regular & (xd < mid_down * mid_down), down, s)


def quantize_int8(
    x: torch.Tensor,
    *,
    granularity: str,
    block: int,
    center: torch.Tensor | None = None,
    center_per_block: bool = False,
    balance: tuple[torch.Tensor, torch.Tensor] | None = None,
    role: str = "q",
    scale_multiplier: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8: ``s = amax(|y|)/127`` per group, ``round_half_even(y/s)`` in ``[-127, 127]``,
    where ``y = (x - center)`` times the balancing factor of its channel.

    Args:
        x: ``[B, H, N, D]`` (any float dtype).
        granularity: ``"per_block"`` (one scale per ``block`` tokens), ``"per_token"`` or
            ``"per_thread"`` (the groups of :func:`thread_groups` for ``role``).
        center: ``[B, H, D]``, or ``[B, H, nb, D]`` with ``center_per_block``; ``None`` for no shift.
        balance: ``(amax_q [B, Hq, D], amax_k [B, Hkv, D])`` to multiply Q's channels by
            ``α`` (``role="q"``) or K's by ``1/α`` (``"k"``), see :func:`balance_factors`.
        role: ``"q"`` or ``"k"``: which operand ``x`` is (the balancing direction, and the
            per-thread groups).
        scale_multiplier: folded into the returned scales (``softmax_scale·log2 e`` for Q).
    Returns:
        ``(values int8 [B, H, N, D], scales fp32 [B, H, nb], [B, H, N] or [B, H, groups])``.
    """
    b, h, n, d = x.shape
    y = x.float()
    if center is not None:
        y = y - (expand_blocks(center, block, n) if center_per_block else center.unsqueeze(-2))
    if balance is not None:
        alpha = balance_factors(*balance)
        if role == "q":
            multiplier = alpha.repeat_interleave(h // alpha.shape[1], dim=1)
        else:
            multiplier = 1.0 / alpha
        y = y * multiplier.unsqueeze(-2)
    if granularity == "per_token":
        amax = y.abs().amax(dim=-1) + nonfinite_guard(y, -1)
        scale = _int8_scale(amax)
        per_row = scale
    elif granularity == "per_block":
        nb = -(-n // block)
        padded = torch.nn.functional.pad(y, (0, 0, 0, nb * block - n)).reshape(b, h, nb, block * d)
        amax = padded.abs().amax(dim=-1) + nonfinite_guard(padded, -1)
        scale = _int8_scale(amax)
        per_row = scale.repeat_interleave(block, dim=-1)[..., :n]
    elif granularity == "per_thread":
        rows = y.abs().amax(dim=-1) + nonfinite_guard(y, -1)
        scale = _int8_scale(thread_group_amax(rows, role))
        per_row = scale[..., thread_groups(n, role, y.device)]
    else:
        raise ValueError(
            f"granularity must be 'per_block', 'per_token' or 'per_thread', got {granularity!r}")
    values = round_half_even_int8(y / per_row.unsqueeze(-1))
    if scale_multiplier != 1.0:
        scale = scale * scale_multiplier
    return values, scale


def thread_groups(n: int, role: str, device=None) -> torch.Tensor:
    """The per-thread scale group of each of ``n`` rows (int64 ``[n]``), SageAttention2's sm90
    layout: the groups a Hopper wgmma accumulator gives one thread. Q (``role="q"``): rows ``r``
    and ``r + 8`` of each 16-row slice share a scale, 8 per slice (group ``(i // 16)·8 + i % 8``).
    K (``"k"``): in each block of :data:`~lowbit_attn.core.operands.THREAD_K_BLOCK` keys, those
    in columns ``2c, 2c + 1`` (mod 8) share one, 4 per block (group ``(j // 128)·4 + (j % 8) // 2``).
    """
    i = torch.arange(n, device=device)
    if role == "q":
        return (i // THREAD_Q_SLICE) * 8 + i % 8
    return (i // THREAD_K_BLOCK) * 4 + (i % 8) // 2


def thread_group_amax(rows: torch.Tensor, role: str) -> torch.Tensor:
    """``[B, H, N]`` amax of each row → ``[B, H, groups]`` amax of each :func:`thread_groups`
    group (rows past ``N`` count as 0; NaN stays NaN)."""
    b, h, n = rows.shape
    span = THREAD_Q_SLICE if role == "q" else THREAD_K_BLOCK
    blocks = -(-n // span)
    padded = torch.nn.functional.pad(rows, (0, blocks * span - n))
    if role == "q":  # [slice, r + 8·half] → max over the halves
        return padded.view(b, h, blocks, 2, 8).amax(dim=3).reshape(b, h, blocks * 8)
    # [block, 8·g + 2·c + p] → max over g and p
    return padded.view(b, h, blocks, span // 8, 4, 2).amax(dim=(3, 5)).reshape(b, h, blocks * 4)


def _int8_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax * (1.0 / INT8_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def round_half_even_int8(y: torch.Tensor) -> torch.Tensor:
    """Round half to even, clamp to ±127, NaN → 0 (its scale is NaN, which carries it), to int8."""
    r = torch.clamp(torch.round(y), -INT8_MAX, INT8_MAX)
    return torch.nan_to_num(r, nan=0.0).to(torch.int8)


def convert_v(
    x: torch.Tensor,
    *,
    pv: str,
    center: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    permuted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V for the P·V product: ``y = x - center`` (fp32) divided by a per-channel scale ``s`` and
    rounded to E4M3 with ``s = amax/448`` (``pv="fp8"``), or to fp16 with ``s`` the power of two of
    :func:`fp16_v_scale` (``pv="fp16"``; without ``amax``, unscaled: ``s`` None).

    Args:
        amax: ``max |y|`` per channel ``[B, H, D]`` fp32 (NaN if V is not finite).
        permuted: E4M3 only: the keys in the stored order of :func:`permute_keys`.
    Returns:
        ``(values [B, H, N, D] (permuted: [B, H, N', D]), s [B, H, D] fp32 or None)``: V ≈
        ``values·s``.
    """
    y = x.float()
    if center is not None:
        y = y - center.unsqueeze(-2)
    if pv != "fp8":
        if amax is None:
            return y.to(torch.float16), None
        scale, inverse = fp16_v_scale(amax)
        return (y * inverse.unsqueeze(-2)).to(torch.float16), scale
    scale = amax * (1.0 / FP8_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = to_e4m3(y / scale.unsqueeze(-2))
    return (permute_keys(values) if permuted else values), scale


def permute_keys(v: torch.Tensor) -> torch.Tensor:
    """``[..., N, D]`` → ``[..., N', D]`` in the stored order of ``QuantizedQKV.v_permuted``: keys
    padded with zeros to ``N' = core.operands.permuted_v_keys(N)``, then position ``16g + i``
    holding key ``16g + V_KEY_ORDER[i]``."""
    n = v.shape[-2]
    padded = torch.zeros(v.shape[:-2] + (permuted_v_keys(n), v.shape[-1]), dtype=v.dtype,
                         device=v.device)
    padded[..., :n, :] = v
    return padded[..., key_order(padded.shape[-2], v.device), :]


def unpermute_keys(v: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`permute_keys`: the first ``n`` keys in their own order."""
    natural = torch.empty_like(v)
    natural[..., key_order(v.shape[-2], v.device), :] = v
    return natural[..., :n, :]


def key_order(n: int, device=None) -> torch.Tensor:
    """The key stored at each of ``n`` positions (``n`` a multiple of 16)."""
    order = torch.tensor(V_KEY_ORDER, device=device)
    return (torch.arange(0, n, 16, device=device)[:, None] + order[None, :]).reshape(-1)


def fp16_v_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^e, 2^-e)`` fp32 per channel for fp16 V (see ``quantized.FP16_V_KEEP_LO``): ``e = 0``
    where amax's binary exponent is in ``[FP16_V_KEEP_LO, FP16_V_KEEP_HI]``, amax is 0 or it is
    not finite (Inf and NaN reach fp16 as they are); else ``amax·2^-e`` gets the exponent
    ``FP16_V_KEEP_HI`` (``e ≥ -126``: an fp32 subnormal amax only gets to about 2^-23). Computed
    from amax's bits, as the kernel does."""
    biased = (amax.float().contiguous().view(torch.int32) >> 23) & 0xFF
    exp = biased - 127
    keep = (biased == 255) | (amax == 0) | ((exp >= FP16_V_KEEP_LO) & (exp <= FP16_V_KEEP_HI))
    e = torch.where(keep, 0, torch.clamp(exp - FP16_V_KEEP_HI, min=-126))
    return ((e + 127) << 23).view(torch.float32), ((127 - e) << 23).view(torch.float32)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 → E4M3 (``float8_e4m3fn``): round to nearest even, saturate to ±448, NaN stays NaN."""
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

