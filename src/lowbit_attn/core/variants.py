"""The LLM attention variants (issue 44): a sliding window, chunked local attention, logit
soft-capping, and per-head attention sinks.

:class:`Variant` is the one frozen description the public calls build and carry to the kernels.
Its visibility rule lives here once, in three forms that the tests hold to one another: the
PyTorch mask (:meth:`Variant.visible`: the twins, the exact recipe), the pure-Python key-block
range of one query block (:func:`key_block_range`), and the same formula as a Triton function
(``core.triton_helpers.window_block_bounds``, which the kernels' loops run and a test kernel
compares with :func:`key_block_range`).

Positions are aligned bottom-right: query ``i`` of ``Nq`` sits at position ``p = i + Nk - Nq``
among ``Nk`` keys (``offset = Nk - Nq``). Key ``j`` is visible to query ``i`` iff

* ``p - left <= j`` (when ``left >= 0``),
* ``j <= p + right`` (when ``right >= 0``; causal attention is ``right = 0``),
* ``j // chunk == p // chunk`` and ``p >= 0`` (when ``chunk > 0``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from lowbit_attn.core import checks

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Variant:
    """What an attention call computes beyond ``softmax(q·kᵀ·scale)·v`` with a causal mask.

    ``left``/``right``: how many keys before/after the query's aligned position it sees (``-1``:
    unbounded); ``right`` is 0 when the call is causal. ``chunk``:
    the chunk size of chunked local attention (0: off). ``softcap``: ``c`` of
    ``S ← c·tanh(S/c)`` on the scaled scores (0.0: off). ``sinks``: whether a per-head sink
    logit joins every row's softmax (the tensor itself travels beside the description)."""

    left: int = -1
    right: int = -1
    chunk: int = 0
    softcap: float = 0.0
    sinks: bool = False

    @property
    def windowed(self) -> bool:
        """Whether the visibility rule needs this description (a left bound, a right bound past
        the diagonal, or a chunk); otherwise it is the plain causal rule (``right == 0``) or
        none (``right == -1``), which the kernels run as before."""
        return self.left >= 0 or self.right > 0 or self.chunk > 0

    @property
    def causal(self) -> bool:
        """Not :attr:`windowed` and bounded at the diagonal: plain causal attention."""
        return not self.windowed and self.right == 0

    @property
    def plain(self) -> bool:
        """Nothing beyond plain (causal) attention."""
        return not self.windowed and self.softcap == 0.0 and not self.sinks

    def visible(self, rows: torch.Tensor, cols: torch.Tensor, offset: int) -> torch.Tensor:
        """Boolean ``[len(rows), len(cols)]``: which keys ``cols`` the queries ``rows`` see, for
        ``offset = Nk - Nq`` (the rule of the module docstring)."""
        p = (rows + offset)[:, None]
        j = cols[None, :]
        ok = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
        if self.left >= 0:
            ok = ok & (j >= p - self.left)
        if self.right >= 0:
            ok = ok & (j <= p + self.right)
        if self.chunk > 0:
            ok = ok & (p >= 0) & (j // self.chunk == p.clamp(min=0) // self.chunk)
        return ok


PLAIN = Variant()


def key_block_range(nk: int, row_lo: int, row_hi: int, offset: int, left: int, right: int,
                    chunk: int, block_n: int) -> tuple[int, int, int, int]:
    """``(lo, full_lo, full_hi, hi)`` of one query block, rows ``[row_lo, row_hi)``: the key
    blocks from ``lo`` (a multiple of ``block_n``) up to ``hi`` hold every key some row sees;
    those in ``[full_lo, full_hi)`` (multiples of ``block_n``) are seen whole by every row, so
    they need no mask. ``lo <= full_lo <= full_hi``; nothing to visit when ``hi <= lo``.

    The formula of ``core.triton_helpers.window_block_bounds`` (the kernels' loop bounds), in
    Python; every division has a non-negative dividend (C's and Python's agree there)."""
    a = row_lo + offset  # the first row's position
    z = row_hi - 1 + offset  # the last row's
    lo, hi, in_lo, in_hi = 0, nk, 0, nk  # union and intersection of the rows' key ranges
    if left >= 0:
        lo = max(lo, a - left)
        in_lo = max(in_lo, z - left)
    if right >= 0:
        hi = min(hi, z + right + 1)
        in_hi = min(in_hi, a + right + 1)
    if chunk > 0:
        ca = max(a, 0) // chunk * chunk
        cz = max(z, 0) // chunk * chunk
        lo = max(lo, ca)
        hi = min(hi, cz + chunk if z >= 0 else 0)
        one = ca == cz and a >= 0  # every row in one chunk
        in_lo = max(in_lo, ca if one else nk)
        in_hi = min(in_hi, ca + chunk if one else 0)
    lo = max(lo, 0) // block_n * block_n
    full_lo = (max(in_lo, 0) + block_n - 1) // block_n * block_n
    full_hi = max(min(in_hi, nk), 0) // block_n * block_n
    if full_hi <= full_lo:
        full_lo = full_hi = lo
    return lo, full_lo, full_hi, hi


def query_block_range(nq: int, col_lo: int, col_hi: int, offset: int, left: int, right: int,
                      chunk: int, block_m: int) -> tuple[int, int]:
    """``(lo, hi)`` of one key block, keys ``[col_lo, col_hi)``: the query rows from ``lo`` (a
    multiple of ``block_m``) to ``hi`` hold every row that sees one of its keys (the trainable
    backward's dK/dV loop; ``core.triton_helpers.window_query_bounds``, the same formula)."""
    lo = max(col_lo - offset - right, 0) if right >= 0 else 0
    hi = min(col_hi - offset + left, nq) if left >= 0 else nq
    if chunk > 0:
        lo = max(lo, col_lo // chunk * chunk - offset)
        hi = min(hi, ((col_hi - 1) // chunk + 1) * chunk - offset)
    return lo // block_m * block_m, hi


def key_blocks_visited(nq: int, nk: int, variant: Variant, block_m: int,
                       block_n: int) -> list[int]:
    """How many key blocks each query block of the Triton forwards visits: from
    :func:`key_block_range` with a window or chunk, up to the diagonal when causal, else all."""
    offset = nk - nq
    counts = []
    for row_lo in range(0, nq, block_m):
        row_hi = row_lo + block_m
        if variant.windowed:
            lo, _, _, hi = key_block_range(nk, row_lo, row_hi, offset, variant.left,
                                           variant.right, variant.chunk, block_n)
        else:
            lo, hi = 0, min(nk, row_hi + offset) if variant.causal else nk
        counts.append(max(0, -(-(hi - lo) // block_n)))
    return counts


def _int_side(name: str, value) -> int:
    value = checks.concrete(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (-1: unbounded), got {value!r}")
    value = int(value)
    if value < -1:
        raise ValueError(f"{name} must be >= 0 or -1 (unbounded), got {value}")
    return value


def check(*, is_causal: bool, window, softcap, chunk, sinks, hq: int,
          device: torch.device) -> Variant:
    """The variant of a call from its public arguments, validated (errors name the argument).

    ``window``: ``None`` or ``(left, right)`` ints, each ``>= 0`` or ``-1``; with ``is_causal``
    ``right`` becomes 0 (FlashAttention: causal is ``right = 0``). ``softcap``: see
    :func:`check_softcap`. ``chunk``: ``None`` or a positive int. ``sinks``: see
    :func:`check_sinks`. A window and a chunk may be given together: a key must then satisfy
    both."""
    left = right = -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be None or a (left, right) pair of ints, got {window!r}")
        left = _int_side("window[0] (left)", window[0])
        right = _int_side("window[1] (right)", window[1])
    if is_causal:
        right = 0
    cap = check_softcap(softcap)
    size = 0
    if chunk is not None:
        chunk = checks.concrete(chunk)
        if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral):
            raise TypeError(f"chunk must be an int or None, got {chunk!r}")
        size = int(chunk)
        if size <= 0:
            raise ValueError(f"chunk must be a positive int (or None: off), got {chunk!r}")
        if size >= 2**30:
            raise ValueError(f"chunk must be below 2**30, got {chunk!r}")
    for name, side in (("window[0] (left)", left), ("window[1] (right)", right)):
        if side >= 2**30:
            raise ValueError(f"{name} must be below 2**30, got {side}")
    check_sinks(sinks, hq, device)
    return Variant(left=left, right=right, chunk=size, softcap=cap, sinks=sinks is not None)


# The largest softcap c: the kernels' tanh (``softcap_scores``) is exact to ~3e-8 absolute, so a
# capped score is off by up to ~c·3e-8 (2e-3 at 2**16, a tenth of an 8-bit score's rounding;
# 3 at 1e8). Models use 30 or 50.
SOFTCAP_MAX = 2.0**16


def check_softcap(softcap) -> float:
    """``softcap``: ``None`` or 0 (off: 0.0 returned), or a real number from 2**-125 to
    :data:`SOFTCAP_MAX`, returned as a float."""
    softcap = checks.concrete(softcap)
    if softcap is None or (isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
                           and softcap == 0):
        return 0.0
    return checks.positive_float("softcap", softcap, top=(
        SOFTCAP_MAX, "2**16 = 65536 (the kernels compute in float32, their tanh exact to "
        "~softcap·3e-8; pass None for no cap)"))


def check_sinks(sinks, hq: int, device: torch.device) -> None:
    """``sinks``: ``None`` or a ``[hq]`` float32/bfloat16/float16 tensor on ``device`` that
    needs no gradient (the kernels are forward-only)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"sinks must be float32, bfloat16 or float16, got {sinks.dtype}")
    if tuple(sinks.shape) != (hq,):
        raise ValueError(
            f"sinks must have shape ({hq},) (one logit per query head), got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")
    if sinks.requires_grad and torch.is_grad_enabled():
        raise ValueError("sinks must not require grad: the attention kernels are forward-only")


def sink_logits(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as the kernels and their twins take them: fp32, in base 2 (``sinks·log2 e``)."""
    return None if sinks is None else (sinks.float() * LOG2E).contiguous()


def softcap_base2(s: torch.Tensor, softcap: float,
                  shift: torch.Tensor | float = 0.0) -> torch.Tensor:
    """The kernels' soft-capping of base-2 scores ``s`` (fp32) that K smoothing lowered by
    ``shift`` (base 2, per row, or 0): ``C·tanh((s + shift)/C') - shift`` with ``C = c·log2 e``,
    tanh as ``1 - 2/(2^(2x) + 1)`` on ``(s + shift)·(2/c)`` (exp2 of ±∞ gives ±1; NaN stays
    NaN). Twin of ``triton_helpers.softcap_scores``, step for step."""
    cap2, two_over = _cap_constants(softcap, s.dtype)
    u = s + shift
    e = torch.exp2(u * two_over)
    t = 1.0 - 2.0 / (e + 1.0)
    return t * cap2 - shift


def _cap_constants(softcap: float, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c·log2 e, 2/c)`` rounded to fp32, as the kernels get them; in float64 for float64
    scores (the exact recipe on float64 inputs keeps their precision)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.tensor(softcap * LOG2E, dtype=dtype), torch.tensor(2.0 / softcap, dtype=dtype))


def cap_args(softcap: float) -> tuple[float, float]:
    """``(c·log2 e, 2/c)`` as the fp32 values the kernels get (0 when off)."""
    if not softcap:
        return 0.0, 0.0
    a, b = _cap_constants(softcap)
    return float(a), float(b)


def variant_args(variant: Variant) -> dict:
    """The kernels' runtime and constexpr arguments of a variant's window, chunk and softcap
    (``left``, ``right``, ``chunk``, ``cap2``, ``two_over``, ``WINDOWED``, ``SOFTCAP``)."""
    cap2, two_over = cap_args(variant.softcap)
    return dict(left=variant.left, right=variant.right, chunk=variant.chunk, cap2=cap2,
                two_over=two_over, WINDOWED=variant.windowed, SOFTCAP=variant.softcap > 0)
