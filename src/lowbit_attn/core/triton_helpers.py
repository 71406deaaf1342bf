"""Pieces shared by the Triton kernels: exact rounding helpers, the attention kernels' loop bounds
and epilogue, launch configs and stride bookkeeping."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.operands import LOG2_FP8_MAX, TILE_AMAX_FLOOR, token_major  # noqa: F401

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)
_LOG2_FP8_MAX = tl.constexpr(LOG2_FP8_MAX)
_TILE_AMAX_FLOOR = tl.constexpr(TILE_AMAX_FLOOR)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch options of one autotuning candidate, and constexpr meta-parameters (``meta``:
    ``(name, value)`` pairs) that select a variant of the kernel's code."""

    num_warps: int
    num_stages: int
    meta: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.meta)


def family(capability) -> str:
    """The key of a kernel module's ``CONFIGS`` for the machine: ``"interpreter"`` (or no GPU),
    ``"sm_90"`` from Hopper on, ``"sm_89"``, ``"sm_80"``."""
    if interpreter_enabled() or capability is None:
        return "interpreter"
    if capability >= (9, 0):
        return "sm_90"
    if capability >= (8, 9):
        return "sm_89"
    return "sm_80"


def configs_for(configs: dict[str, list[LaunchConfig]], capability) -> list[LaunchConfig]:
    """A kernel module's ``CONFIGS`` entry for the machine (:func:`family`)."""
    return configs[family(capability)]


AUTOTUNE = ("measured", "all", "first")


def autotune_mode() -> str:
    """``LOWBIT_ATTN_AUTOTUNE``: ``measured`` (default: a launch that an entry of
    :data:`~lowbit_attn.core.measured.MEASURED` covers on this machine's family runs that
    candidate alone, for kernels whose prune filter ends in :func:`choose`; the autotuner times
    every candidate of :func:`configs_for` for the rest), ``all`` (the autotuner for every
    launch) or ``first`` (each autotuned kernel gets its family's first candidate alone, so a new
    shape compiles one kernel, not all of them: for test runs, where tests/test_gpu.py checks
    every candidate of the INT8 forward on its own). ``first`` is read when a kernel module is
    imported, the others at each new autotuning key."""
    mode = os.environ.get("LOWBIT_ATTN_AUTOTUNE", "measured")
    if mode not in AUTOTUNE:
        raise ValueError(f"LOWBIT_ATTN_AUTOTUNE must be one of {AUTOTUNE}, got {mode!r}")
    return mode


def triton_configs(configs: dict[str, list[LaunchConfig]], capability, *,
                   pruned: bool = False) -> list:
    """The ``triton.Config`` s an autotuned kernel gets: :func:`configs_for`'s, or only the first
    under ``LOWBIT_ATTN_AUTOTUNE=first``; with ``pruned`` (a kernel whose prune filter ends in
    :func:`choose`) all of them, the filter choosing among those it keeps."""
    chosen = configs_for(configs, capability)
    if autotune_mode() == "first" and not pruned:
        chosen = chosen[:1]
    return [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in chosen]


def choose(kept: list, kernel: str, args: dict) -> list:
    """What a prune filter returns of the candidates it keeps for a launch of ``kernel`` with
    ``args``, ``kept``: under ``LOWBIT_ATTN_AUTOTUNE=measured`` (the default), the candidate
    that an entry of :data:`~lowbit_attn.core.measured.MEASURED` names for this machine's family,
    alone (Triton then compiles that one only: :func:`tuned`), where one applies and is
    kept; under ``first`` the first kept (a head dim whose candidates are not the family's
    first, D = 256 in ``inference/kernel_int8.py``, gets its own first); else all of them."""
    mode = autotune_mode()
    if mode == "first":
        return kept[:1]
    if mode == "measured":
        from lowbit_attn.core.arch import get_capability
        from lowbit_attn.core.measured import measured

        pick = measured(kernel, family(get_capability()), args)
        if pick is not None:
            same = [c for c in kept if (c.num_warps, c.num_stages) == (pick.num_warps,
                                                                       pick.num_stages)
                    and c.kwargs == {**c.kwargs, **dict(pick.meta)}]
            if same:
                return same[:1]
    return kept


class _Tuner(triton.runtime.Autotuner):
    """The package's autotuner. A candidate its prune filter keeps alone is not timed. Under
    ``LOWBIT_ATTN_AUTOTUNE=measured`` (the default) the timings of a launch it chose among
    several candidates are kept on disk, in Triton's cache (Triton's own ``cache_results``,
    keyed by Triton, the backend, the kernel's source, the autotuning key and the candidates),
    so that a later process runs the choice without compiling and timing each candidate again;
    ``all`` times every new key anew and keeps nothing; in the interpreter nothing is kept."""

    def prune_configs(self, kwargs):
        kept = super().prune_configs(kwargs)
        self.lone = len(kept) == 1
        self.cache_results = (len(kept) > 1 and autotune_mode() == "measured"
                              and not interpreter_enabled())
        return kept

    def _bench(self, *args, config, **meta):
        if getattr(self, "lone", False):  # nothing to choose between
            return [0.0, 0.0, 0.0]
        return super()._bench(*args, config=config, **meta)


def tuned(tuner):
    """``tuner`` (a ``triton.autotune`` result) made the package's :class:`_Tuner`: a candidate
    its prune filter keeps alone (a measured one, or ``first``'s) is not timed (Triton 3.6
    times it all the same, ``do_bench``: ~0.1 s of a new shape's first call; 3.9 does not), and
    its choices among several are kept on disk for later processes."""
    tuner.__class__ = _Tuner
    return tuner


def autotuned(configs: dict[str, list[LaunchConfig]], **options):
    """``triton.autotune`` over :func:`triton_configs` of ``configs`` (``options``: its other
    arguments), made :func:`tuned`; it keeps ``configs`` as ``family_configs``, where the AOT
    compiler (``tools/aot.py``) reads them (a kernel whose candidates are not its module's
    ``CONFIGS``)."""
    from lowbit_attn.core.arch import get_capability

    def wrap(fn):
        tuner = tuned(triton.autotune(configs=triton_configs(configs, get_capability()),
                                      **options)(fn))
        tuner.family_configs = configs
        return tuner

    return wrap


@triton.jit
def key_block_bounds(nk, pid_m, causal_offset, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """``(full_hi, hi)`` for one query block: key blocks below ``full_hi`` are seen whole by every
    row (no masks needed), those in ``[full_hi, hi)`` hold the sequence's tail or the causal
    diagonal; keys from ``hi`` on are seen by no row."""
    full_hi = (nk // BLOCK_N) * BLOCK_N
    hi = nk
    if IS_CAUSAL:
        hi = tl.minimum(nk, (pid_m + 1) * BLOCK_M + causal_offset)
        first_row_sees = pid_m * BLOCK_M + causal_offset + 1
        full_hi = tl.minimum(full_hi, tl.maximum(first_row_sees, 0) // BLOCK_N * BLOCK_N)
    return full_hi, hi


@triton.jit
def window_block_bounds(nk, pid_m, offset, left, right, chunk, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)`` of one query block under a window and/or chunk
    (``core.variants.key_block_range``, the same formula: a test kernel holds them together):
    key blocks from ``lo`` to ``hi`` hold every key a row of the block sees, those in
    ``[full_lo, full_hi)`` are seen whole by every row. ``offset``: ``Nk - Nq``; ``left``,
    ``right``: -1 unbounded; ``chunk``: 0 off. Dividends are never negative (C's division and
    Python's agree)."""
    a = pid_m * BLOCK_M + offset  # the first row's position
    z = a + (BLOCK_M - 1)  # the last row's
    lo = tl.where(left >= 0, tl.maximum(a - left, 0), 0)
    in_lo = tl.where(left >= 0, tl.maximum(z - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(z + right + 1, nk), nk)
    in_hi = tl.where(right >= 0, tl.minimum(a + right + 1, nk), nk)
    on = chunk > 0
    c = tl.maximum(chunk, 1)
    ca = tl.maximum(a, 0) // c * c
    cz = tl.maximum(z, 0) // c * c
    lo = tl.where(on, tl.maximum(lo, ca), lo)
    hi = tl.where(on, tl.minimum(hi, tl.where(z >= 0, cz + c, 0)), hi)
    one = (ca == cz) & (a >= 0)  # every row in one chunk
    in_lo = tl.where(on, tl.maximum(in_lo, tl.where(one, ca, nk)), in_lo)
    in_hi = tl.where(on, tl.minimum(in_hi, tl.where(one, ca + c, 0)), in_hi)
    lo = lo // BLOCK_N * BLOCK_N
    full_lo = (in_lo + (BLOCK_N - 1)) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(in_hi, 0) // BLOCK_N * BLOCK_N
    none = full_hi <= full_lo
    return lo, tl.where(none, lo, full_lo), tl.where(none, lo, full_hi), hi


@triton.jit
def window_query_bounds(nq, pid_n, offset, left, right, chunk, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """``(lo, hi)``: the query rows from ``lo`` (a multiple of ``BLOCK_M``) to ``hi`` hold every
    row that sees a key of key block ``pid_n`` under a window and/or chunk (the backward's dK/dV
    loop; ``core.variants.query_block_range``, the same formula)."""
    c0 = pid_n * BLOCK_N
    c1 = c0 + BLOCK_N
    lo = tl.where(right >= 0, tl.maximum(c0 - offset - right, 0), 0)
    hi = tl.where(left >= 0, tl.minimum(c1 - offset + left, nq), nq)
    ch = tl.maximum(chunk, 1)
    lo = tl.where(chunk > 0, tl.maximum(lo, c0 // ch * ch - offset), lo)
    hi = tl.where(chunk > 0, tl.minimum(hi, ((c1 - 1) // ch + 1) * ch - offset), hi)
    return lo // BLOCK_M * BLOCK_M, hi


@triton.jit
def window_limits(r, offset, left, right, chunk, nk):
    """``(first, last)`` per query row ``r`` (``core.variants.Variant.visible``): the keys a row
    sees under a window and/or chunk are an interval (the window's half-lines, the row's chunk and
    ``c < nk`` intersected), key ``c`` seen iff ``first <= c <= last`` (``last < first``: none).
    Found once per row, then two compares per score (every kernel's masked window blocks; sm_90a,
    the Triton forward's: 682 instructions per tile where a per-score rule took 908, NOTES §30)."""
    p = r + offset
    first = tl.where(left >= 0, p - left, 0)
    last = tl.where(right >= 0, tl.minimum(p + right, nk - 1), nk - 1)
    ch = tl.maximum(chunk, 1)
    start = tl.maximum(p, 0) // ch * ch
    first = tl.where(chunk > 0, tl.maximum(first, start), first)
    last = tl.where(chunk > 0, tl.where(p >= 0, tl.minimum(last, start + (ch - 1)), -1), last)
    return first, last


@triton.jit
def softcap_scores(s, cap2, two_over, shift):
    """Soft-capped base-2 scores: ``cap2·tanh(u/cap2) - shift`` with ``u = s + shift`` (the
    true score: ``shift`` is what K smoothing took off each query row, base 2, broadcast to the
    tile: ``[rows, 1]``, or ``[1, cols]`` in a transposed tile) and tanh as ``1 - 2/(2^(u·two_over)
    + 1)`` (``cap2 = c·log2 e``, ``two_over = 2/c``; ±∞ give ±1, NaN stays). Twin:
    ``core.variants.softcap_base2``, step for step."""
    u = s + shift
    e = tl.exp2(u * two_over)
    t = 1.0 - 2.0 / (e + 1.0)
    return t * cap2 - shift


@triton.jit
def finish_scores(s, cols, nmask, offs_m, causal_offset, ds_base, sdn, HAS_DS: tl.constexpr,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, window=None,
                  WINDOWED: tl.constexpr = False, cap=None, SOFTCAP: tl.constexpr = False):
    """A score tile in base 2 with the Q-smoothing correction ΔS added, soft-capped
    (``SOFTCAP``: ``cap = (c·log2 e, 2/c, the rows' K-smoothing shift)``, before the masks) and,
    in ``MASKED`` blocks, ``-inf`` for keys past the end, past the causal diagonal or, with
    ``WINDOWED``, outside each row's ``window = (first, last)`` (``window_limits`` of the rows,
    found once per program: two compares per score)."""
    if HAS_DS:
        ds = tl.load(ds_base + cols * sdn, mask=nmask, other=0.0)
        s = s + ds[None, :]
    if SOFTCAP:
        s = softcap_scores(s, cap[0], cap[1], cap[2][:, None])
    if MASKED:
        if WINDOWED:
            valid = (cols[None, :] >= window[0][:, None]) & (cols[None, :] <= window[1][:, None])
        elif IS_CAUSAL:
            valid = (cols[None, :] <= offs_m[:, None] + causal_offset) & nmask[None, :]
        else:
            valid = nmask[None, :]
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def add_sink(acc, m_i, l_i, sink, offset):
    """The sink's term after the key blocks: the row max raised to the sink's logit ``sink``
    (base 2, in the scores' frame) when above, ``2^(sink - m + offset)`` added to the row sum.
    Returns ``(acc, m, l, w)``, ``w`` the keys' share of the sum (V's mean is added in that
    proportion). Twin: ``inference.naive.add_sink``."""
    m_new, m_safe, alpha = online_max(m_i, sink)
    l_keys = l_i * alpha
    l_i = l_keys + tl.exp2(sink - (m_safe - offset))
    return acc * alpha[:, None], m_new, l_i, l_keys / l_i


@triton.jit
def p_offset(PV_FP8: tl.constexpr):
    """What the softmax's exp2 adds to every score, in base 2: log2 448 for E4M3 P̃ (its range
    used whole), 0 for 16-bit P̃ (``naive.softmax_step``'s ``offset``)."""
    if PV_FP8:
        return _LOG2_FP8_MAX
    else:
        return 0.0


@triton.jit
def online_max(m_i, block_max, MASKED: tl.constexpr = True):
    """``(m_new, m_safe, alpha)`` of the online softmax: the running row max, the same with 0 for
    rows that have seen no key yet (subtracting -inf would give NaN), the rescale factor. Without
    ``MASKED`` every row of the block sees a key (a finite score), so ``m_new`` is ``m_safe``."""
    m_new = tl.maximum(m_i, block_max)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    return m_new, m_safe, tl.exp2(m_i - m_safe)


@triton.jit
def normalize_rows(acc, l_i):
    """``acc / l`` per row, and which rows saw no key (their sum is 0; they give 0, not NaN)."""
    empty = l_i == 0.0
    return acc / tl.where(empty, 1.0, l_i)[:, None], empty


@triton.jit
def finish_rows(acc, l_i, VS, VM, vec_base, offs_d, dmask, svsd, HAS_VSCALE: tl.constexpr,
                HAS_VMEAN: tl.constexpr, vm_weight=None, SINK: tl.constexpr = False):
    """The quantized forwards' epilogue: ``acc / l``, times V's per-channel scale (FP8, or fp16
    V's power of two) when it has one, plus V's mean when V was smoothed (``vec_base``: the
    (batch, head) offset of those vectors; with ``SINK`` times the keys' share ``vm_weight`` of
    each row's sum); rows that saw no key give 0."""
    out, empty = normalize_rows(acc, l_i)
    if HAS_VSCALE:
        vs = tl.load(VS + vec_base + offs_d * svsd, mask=dmask, other=0.0)
        out = out * vs[None, :]
    if HAS_VMEAN:
        vm = tl.load(VM + vec_base + offs_d * svsd, mask=dmask, other=0.0)
        if SINK:
            out = out + vm[None, :] * vm_weight[:, None]
        else:
            out = out + vm[None, :]
    return tl.where(empty[:, None], 0.0, out)


@triton.jit
def store_lse(LSE, lse_offsets, LSH, lsh_offsets, m_i, l_i, offset, mask,
              HAS_LSH: tl.constexpr):
    """Natural-log LSE of each row (``offset``: what the exp2 added to every score, in base 2),
    plus the K-smoothing shift ``LSH`` when given."""
    lse = (m_i + tl.log2(l_i) - offset) * LN2
    if HAS_LSH:
        lse += tl.load(LSH + lsh_offsets, mask=mask, other=0.0)
    tl.store(LSE + lse_offsets, lse, mask=mask)

# fp32 RNE to an integer: adding 1.5·2^23 leaves no fraction bits, so the FPU's own round-to-nearest-
# even does the work; exact for |x| < 2^22. Same bits on a GPU and under the interpreter.
RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_half_even(x):
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def to_int8(y):
    """fp32 → int8: round half to even, clamp to ±127, NaN → 0 (its scale carries the NaN)."""
    r = round_half_even(y)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(y == y, r, 0.0)  # from y: a GPU's min/max turn NaN into the bound
    return r.to(tl.int8)


@triton.jit
def e4m3_round(ax):
    """Non-negative fp32 → ``(nearest E4M3 value as fp32, its 7-bit code as int32)``: round to
    nearest even, saturating at 448. Built from fp32 and integer arithmetic alone. NaN gives garbage:
    callers select their own NaN encoding."""
    ax = tl.minimum(ax, 480.0)
    exp = (ax.to(tl.int32, bitcast=True) >> 23) - 127
    exp = tl.maximum(exp, -6)  # below 2^-6 the E4M3 grid is the subnormal step 2^-9
    # 1.5·2^(exp+20): its ulp is 2^(exp-3), E4M3's spacing at this exponent.
    magic = (((exp + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = tl.minimum((ax + magic) - magic, 448.0)
    rbits = r.to(tl.int32, bitcast=True)
    code = tl.where(
        r >= 0.015625,
        ((((rbits >> 23) - 127) + 7) << 3) | ((rbits >> 20) & 0x7),
        (r * 512.0).to(tl.int32),
    )
    return r, code


@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """fp32 → E4M3 (``float8e4nv``), round to nearest even, saturating to ±448.

    On a GPU the hardware conversion (``cvt.rn.satfinite``) does this. ``EXACT`` builds the bits
    arithmetically instead, for the interpreter, whose own conversion neither rounds to even nor
    handles subnormals and NaN.
    """
    if EXACT:
        _, code = e4m3_round(tl.abs(x))
        code = tl.where(x < 0, code | 0x80, code)
        code = tl.where(x != x, 0x7F, code)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def key_position(k):
    """Where key ``k`` is stored in E4M3 V whose keys are permuted in groups of 16
    (``core.operands.V_KEY_ORDER``: key ``16g + 8h + 2c + p`` at ``16g + 4c + 2h + p``)."""
    return (k // 16) * 16 + ((k % 8) // 2) * 4 + ((k // 8) % 2) * 2 + k % 2


@triton.jit
def seq_span(CU, b, N, VARLEN: tl.constexpr):
    """First token (int64, so that token offsets never overflow) and length of sequence ``b``."""
    if VARLEN:
        start = tl.load(CU + b).to(tl.int64)
        n = tl.load(CU + b + 1) - tl.load(CU + b)
    else:
        start = b.to(tl.int64) * 0
        n = N
    return start, n


@triton.jit
def packed_v_start(k_start, b):
    """First stored token of packed sequence ``b``'s E4M3 V, whose keys start at ``k_start``
    (``core.operands.packed_v_starts``): a product by 16, which the compiler sees as aligned
    (Triton 3.6 drops ``tl.multiple_of`` on a scalar)."""
    return (k_start // 16 + b) * 16


@triton.jit
def batch_head(pid_bh, H):
    """(batch, head) of a program as int64: ``b·stride`` may pass 2^31 elements in large tensors."""
    return (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)


@triton.jit
def program_heads(HQ, GROUP):
    """``(pid, b, h, hk)`` of a program on the grid ``(blocks of tokens, batch·query heads)``: its
    block, its batch and query head (int64, :func:`batch_head`) and the K/V head that query head
    reads (``GROUP`` query heads share one)."""
    pid = tl.program_id(0)
    b, h = batch_head(tl.program_id(1), HQ)
    return pid, b, h, h // GROUP


def exact_fp8() -> bool:
    """Whether kernels must build E4M3 bits arithmetically (under the interpreter)."""
    return interpreter_enabled()


# Kernels take each tensor's strides as one tuple argument, passed by keyword (``q_strides=...``)
# and unpacked by name at the kernel's top; Triton specializes the tuple element by element, as it
# would separate arguments (1 becomes a constant, multiples of 16 are marked divisible).


def strides(x: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """``x.stride()`` (``ndim`` of them), or zeros for an absent tensor."""
    if x is None:
        return (0,) * ndim
    assert x.dim() == ndim, f"expected a {ndim}-D tensor, got shape {tuple(x.shape)}"
    return tuple(x.stride())


def operand(values: torch.Tensor, scales: torch.Tensor) -> tuple:
    """A quantized operand as one kernel argument: ``(values, scales, values' strides, scales'
    strides)``."""
    return (values, scales, tuple(values.stride()), tuple(scales.stride()))



def bhnd_strides(x: torch.Tensor | None, packed: bool) -> tuple[int, int, int, int]:
    """Strides ``(batch, head, token, dim)`` of a logical ``[B, H, N, D]`` tensor, or of a packed
    ``[total, H, D]`` one (batch stride 0: a sequence's first token comes from ``cu_seqlens``)."""
    if x is None:
        return (0, 0, 0, 0)
    if packed:
        return (0, x.stride(1), x.stride(0), x.stride(2))
    return tuple(x.stride())  # type: ignore[return-value]


def row_strides(x: torch.Tensor | None, packed_per_token: bool) -> tuple[int, int, int]:
    """Strides ``(batch, head, row)`` of a scale/LSE vector: ``[B, H, R]``, or ``[H, total]`` for
    per-token vectors of packed calls."""
    if x is None:
        return (0, 0, 0)
    if packed_per_token:
        return (0, x.stride(0), x.stride(1))
    return tuple(x.stride())  # type: ignore[return-value]


def channel_vector_strides(vec: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of a contiguous ``[B, H, D]`` statistics vector (dim stride 1)."""
    if vec is None:
        return (0, 0)
    assert vec.is_contiguous()
    return (vec.stride(0), vec.stride(1))


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (0 for 0), as ``triton.next_power_of_2`` on the
    host: that one is a constexpr function, ~1.5 µs a call, and launchers call it per launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, next_power_of_2(n))


@triton.jit
def mm(a, b, INT8: tl.constexpr, EMU_FP32: tl.constexpr):
    """``a·b`` with fp32 results: an int32-accumulated INT8 MMA, or a 16-bit MMA with fp32
    accumulation (in fp32 under ``EMU_FP32``: the interpreter's bf16 products are wrong)."""
    if INT8:
        return tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    elif EMU_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_tile(x, INT8: tl.constexpr, LIKE, KEEP_DIMS: tl.constexpr = False,
                  PER_ROW: tl.constexpr = False, AXIS: tl.constexpr = 1):
    """A tile as a matmul operand: INT8 with one scale ``max(amax, 2^-100)/127`` per tile (NaN/Inf
    poison it), or with ``PER_ROW`` one such scale per row of the product's output, the amax taken
    along ``AXIS`` (the dimension the product contracts; NaN propagates), returned ``[n, 1]``;
    each element the exact product with the scale's reciprocal (one division per scale, not one
    per element) rounded half to even (one fused multiply-add); or ``x`` in the element type of
    the pointer ``LIKE`` with scale 1. ``KEEP_DIMS``: the tile's scale as a ``[1, 1]`` tile instead
    of a scalar (the same value; see :func:`~lowbit_attn.core.arch.tensor_memory`). Twin:
    ``training.naive.quantize_tiles``."""
    if INT8:
        if PER_ROW:
            amax = tl.reduce(tl.abs(x), AXIS, _max_nan, keep_dims=True)
        elif KEEP_DIMS:
            amax = (tl.max(tl.max(tl.abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
                    + tl.sum(tl.sum(x * 0.0, axis=1, keep_dims=True), axis=0, keep_dims=True))
        else:
            amax = (tl.max(tl.max(tl.abs(x), axis=1), axis=0)
                    + tl.sum(tl.sum(x * 0.0, axis=1), axis=0))
        amax = tl.where(amax < _TILE_AMAX_FLOOR, _TILE_AMAX_FLOOR, amax)  # NaN stays NaN
        scale = amax * (1.0 / 127.0)
        r = tl.fma(x, tl.div_rn(1.0, scale), RNE_MAGIC) - RNE_MAGIC  # rounded once
        nan = r != r
        r = tl.where(nan, 0.0, tl.minimum(tl.maximum(r, -127.0), 127.0))
        if PER_ROW and AXIS == 0:
            scale = tl.trans(scale)
        return r.to(tl.int8), scale
    else:
        return x.to(LIKE.dtype.element_ty), 1.0
