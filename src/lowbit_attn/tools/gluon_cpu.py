"""Run a Gluon kernel's own code on CPU tensors, one program after another: a sequential model of
the part of Gluon the Hopper kernels (``inference/kernel_int8_sm90.py``,
``training/kernel_bwd_sm90.py``) and the Blackwell FP4 forward (``inference/kernel_fp4_gluon.py``) use, and of
``gl.warp_specialize``.

Triton 3.6 has no Gluon interpreter. This module executes the kernel's Python function itself
(``jit_function.fn``, and every ``@jit`` helper it calls, with their module globals rebound), so
the grid, the loops over key blocks, the masked/unmasked split, the stage and barrier-phase
arithmetic, the TMA coordinates, the masks and the arithmetic are the kernel's own lines, not a
copy. What stands in for the hardware:

- tensors are torch CPU tensors; distributed layouts are ignored (``convert_layout`` is the
  identity): the Gluon compiler checks them (``tests/inference/test_aot_sm90.py``);
- shared memory holds logical tiles (no swizzle), poisoned at allocation (NaN E4M3, -128 INT8);
- a TMA load gathers its box at issue, with zero fill outside the descriptor's shape, and lands
  only when a ``mbarrier.wait`` on its barrier completes the phase (the latest it may land);
- an mbarrier counts arrivals (``arrive``, ``expect``) and transaction bytes; a phase completes
  when its arrivals reach the init count and every expected byte has landed (an ``arrive`` can
  complete it; later arrivals count towards the next phase; more arrivals than the count in one
  phase is an error). ``wait(bar, parity)`` returns at once when the phase of that parity has
  completed (``(completed & 1) != parity``, the hardware rule); otherwise the barrier's loads
  land and, if the phase still cannot complete, the caller blocks, and :class:`Hang` is raised
  when no partition can run;
- ``warpgroup_mma`` computes its product at issue (operands as they are then); with ``is_async``
  the result is a token that ``warpgroup_mma_wait(n, deps)`` releases when it retires the group
  (groups retire oldest first);
- hazards between these raise :class:`Race`: a wgmma reading a buffer whose TMA load was not
  waited for, or a P̃ tile stored without ``fence_async_shared``; a TMA load or a store into a
  buffer an unretired wgmma reads or a load is still filling; a result read before its group
  retired.

Also modelled, for the Hopper backward (``training/kernel_bwd_sm90.py``): host TMA descriptors
passed as kernel arguments (Gluon's ``TensorDescriptor``, read as the in-kernel ones are; their
``dtype`` and ``layout`` answer), shared-memory ``slice`` views, ``gl.reduce`` (the combine
function folded along the axis in index order), a CTA barrier (``thread_barrier``, 3.9's
``barrier``: a no-op for one sequential thread) and its INT8 conversion (see
:func:`_inline_asm_elementwise`).

``gl.warp_specialize`` runs each partition's function (its args tuple; the default partition's
return value, a tuple as Gluon requires, is returned) in a thread of its own, the threads taking
turns: exactly one runs, and it hands over only at a synchronisation point (mbarrier ``wait`` /
``arrive`` / ``expect``, a TMA issue, a wgmma issue or wait) under a deterministic policy,
``CpuKernel(..., schedule=)``: "lazy" (run until blocked), "eager" (round robin at every
synchronisation point), "reverse" (lazy from the last worker, round the other way).
``gl.num_warps()`` is the partition's warp count. Each partition owns its wgmma groups
(``warpgroup_mma_wait`` retires only its own) and its fences (a fence orders the calling
partition's own stores; a wgmma reading another partition's unfenced store is a race). An exception
in any partition stops them all and is raised by the launch, naming the partition. Across
partitions, a vector clock per partition (barriers carry the clocks of their arrivals to whoever
waits the phase) checks happens-before, not only the order the run took: a write into shared memory
(TMA issue, store) must follow, through barriers, every other partition's retired wgmma read of it
and its stores; a read must follow the TMA phase that filled it and other partitions' stores into
it.

Blackwell (what ``kernel_fp4_gluon`` uses):

- tensor memory (``allocate_tensor_memory``; descriptors' ``index``, ``slice`` of columns,
  ``load``, ``store``) holds logical tiles, poisoned at allocation (NaN fp32 and E4M3, 255 = NaN
  E8M0); scale tiles are ``[rows, K/group]``, whatever layout the kernel declares
  (``TensorMemoryScalesLayout``, ``get_tmem_reg_layout`` and ``SharedLinearLayout`` are layouts:
  ignored). A generic load or store of it is a :class:`Race` while a tcgen05 operation that
  writes it (a store: or reads it) has not completed, and must follow other partitions' accesses
  through barriers (generic loads of tensor memory count as reads for this check);
- ``tcgen05_mma_scaled(a, b, acc, a_scale, b_scale, "e2m1", "e2m1", use_acc=, mbarriers=)``:
  ``a`` ``[M, K/2]`` and ``b`` ``[K/2, N]`` (a permuted K-major tile) E2M1 bytes in shared
  memory, element ``2i`` in the low nibble; scales in tensor memory, E4M3 in groups of 16 (NVFP4)
  or E8M0 bytes in groups of 32 (MXFP4), picked by their type. The dequantized operands' product
  is computed at issue in float64 and rounded once to fp32 (every product is exact; the sum is
  exact while it spans less than float64's 53 bits, true of attention's operands) and written
  to ``acc`` then; the operation stays *in flight* (its operands claimed: overwriting one, or
  reading or writing ``acc`` from another partition, is a :class:`Race`) until it completes, the
  latest it may: when a wait on one of its barriers needs it. It then arrives on each of them.
  A partition's tcgen05 operations complete in issue order (completing one completes every
  earlier one), as the hardware executes them; one without barriers is synchronous;
- ``tcgen05_copy`` (shared → tensor memory) lands at issue and completes with the partition's
  next completed operation; ``tcgen05_commit(bar)`` arrives once every earlier one completes. The
  tensor core is an actor of the vector clocks (one per issuing partition): a partition that
  writes a buffer a tcgen05 operation read, or reads one it wrote, must have waited (through
  some barrier) for that completion; the issuing partition's own later operations are ordered
  by the pipeline. A program ending with an operation never completed is an error;
- ``gl.inline_asm_elementwise`` models only ``quant.fp4.E2M1X2_PTX`` (four
  ``cvt.rn.satfinite.e2m1x2.f32``): the twin's ``e2m1_code`` of each pair, packed ``lo | hi << 4``
  (equal to the instruction for every non-NaN input, tests/quant/test_fp4.py; the NaN code is
  not modelled); ``gl.split``, ``join``, ``reshape``, ``expand_dims``, ``div_rn`` (fp32
  division, correctly rounded as ``div.rn``; ``tl.div_rn`` too, for the ``@triton.jit`` helpers
  a Gluon kernel calls); Blackwell's ``tma`` and ``mbarrier`` are
  Hopper's. During a launch torch tensors answer ``x.to(dtype, bitcast=True)`` (a bit view)
  and ``x.type.layout`` (None).

What the Blackwell part cannot show beyond the rest: the layouts (the 32×4×4 scale atom in shared
memory that ``tcgen05.cp`` reads, the 64-row and 2-column scale tiles stored from registers, the
swizzles), which only a GPU settles; tensor memory's own ordering rules (``tcgen05.wait::st``
after a store, ``tcgen05.fence`` around thread barriers: the compiler's job, not modelled);
``pred``/``mbarrier_preds`` of the MMA (not modelled: :class:`NotModeled`); operand kinds other
than E2M1 pairs; and a fused FMA unless ``fused_fma``.

So the multi-partition model shows the protocol: barrier counts and parities, that every wait
is satisfied (no :class:`Hang`) under the interleavings tried, that buffers are reused only after
their readers released them through barriers, results equal under each policy. What it cannot
show: real concurrency (only the interleavings at synchronisation points that the named policies
produce are run: a hang or a wrong value that needs another interleaving is missed; the
happens-before checks catch an unordered pair of accesses whichever order the run put them in,
but only among the accesses that run made, and a wait takes the clock of the barrier's latest
completed phase, so one that falls two phases behind is not seen), timing and throughput,
register budgets (``worker_num_regs`` is ignored), and races between warps inside one
partition.

Products and row sums are computed in float64 and rounded once to fp32 (``canonical_reductions``
makes the reference do the same); INT8 products are exact either way, and FP8 P̃·V is exact in
float64. ``fma`` is a multiply then an add (two fp32 roundings, the reference's order) unless
``fused_fma``. Integer ``//`` and ``%`` follow Python (Triton truncates toward zero: the same for
the non-negative values the kernel divides). Integer ``+``, ``-`` and ``*`` follow Triton's types
(a kernel's integer arguments are int32 values, or int64 past 2^31, except 1, a constant; a
constant takes the other operand's type; two values the wider one) and an int32 result that does
not hold the exact value raises :class:`Overflow` (on the GPU it wraps: an address offset so
computed points elsewhere).

What it cannot show: anything about time. Asynchrony, barriers as the hardware executes them,
races between warps or warpgroups (one sequential thread stands for the CTA outside
``warp_specialize``, one for each partition inside), swizzled layouts. Those are proven only on
a GPU.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import itertools
import textwrap
import threading
import types
from collections import Counter

import torch
import triton.language as tl
from torch.overrides import TorchFunctionMode

from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("cpu_model", "lowbit_attn.tools.gluon_cpu")

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import blackwell, hopper
from triton.experimental.gluon.language.nvidia.blackwell import tma as real_bw_tma
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as real_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import tma as real_tma


class ScheduleError(AssertionError):
    """The kernel did something the sequential model shows to be wrong."""


class Hang(ScheduleError):
    """An ``mbarrier.wait`` that no armed load or arrival can ever complete."""


class Race(ScheduleError):
    """An access whose result depends on when an asynchronous operation runs."""


class NotModeled(ScheduleError):
    """The kernel uses a Gluon or Triton name this model does not implement."""


class Overflow(ScheduleError):
    """An int32 sum, difference or product whose exact value does not fit in 32 bits: on the GPU
    it wraps (an address offset so computed points elsewhere)."""


# --- numerics --------------------------------------------------------------------------------


def row_sum(x: torch.Tensor, axis: int) -> torch.Tensor:
    """fp32 sum in float64, one rounding: independent of the summation order and of trailing
    zeros (a partial block's zero-filled columns)."""
    return x.double().sum(dim=axis).to(x.dtype)


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64 rounded once to fp32 (INT8 and E4M3 products are exact in float64)."""
    # contiguous: torch's float64 matmul on a transposed view is ~50x slower on the CPU
    return (a.double().contiguous() @ b.double().contiguous()).float()


def exp2(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``exp2`` through float64, rounded once: the same bits wherever the element sits
    (torch's fp32 ``exp2`` takes a vector path or a scalar one by position in the tensor)."""
    return torch.exp2(x.double()).to(x.dtype)


def log2(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log2`` through float64, rounded once (see :func:`exp2`)."""
    return torch.log2(x.double()).to(x.dtype)


_UNARY = {torch.exp2: exp2, torch.log2: log2}


class _Canonical(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNARY and not kwargs and args[0].dtype == torch.float32:
            return _UNARY[func](args[0])
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            a, b = args
            if a.dtype == torch.float32 and b.dtype == torch.float32:
                return product(a, b)
        if func in (torch.sum, torch.Tensor.sum) and args and args[0].dtype == torch.float32:
            x, *rest = args
            return func(x.double(), *rest, **kwargs).float()
        return func(*args, **kwargs)


def canonical_reductions():
    """Context in which fp32 ``torch.matmul``, ``sum``, ``exp2`` and ``log2`` compute in float64
    and round once, as this model's products, ``gl.sum``, ``gl.exp2`` and ``gl.log2`` do: run the
    reference twin under it to compare bit for bit. Without it the bits would depend on shapes,
    not on indices: torch's fp32 sum order depends on the row length (a kernel's partial key block
    has zero-filled columns the twin's slice does not), its ``exp2`` on where an element sits."""
    return _Canonical()


# --- integers --------------------------------------------------------------------------------

# Triton's integer arithmetic, which torch's differs from: a Python int (a constexpr) takes the
# other operand's type, two typed values (tensors, 0-d ones too: kernel arguments, program ids)
# the wider of the two (torch instead lets a 0-d int64 take an int32 tensor's type), and an int32
# result wraps. The model computes in int64 and raises Overflow where an int32 result would not
# hold its exact value.
_INTEGER_OPS = {
    torch.Tensor.add: ("+", lambda a, b: a + b), torch.add: ("+", lambda a, b: a + b),
    torch.Tensor.sub: ("-", lambda a, b: a - b), torch.sub: ("-", lambda a, b: a - b),
    torch.Tensor.__rsub__: ("-", lambda a, b: b - a),
    torch.Tensor.mul: ("*", lambda a, b: a * b), torch.mul: ("*", lambda a, b: a * b),
}
_IN_PLACE = {torch.Tensor.add_: torch.Tensor.add, torch.Tensor.sub_: torch.Tensor.sub,
             torch.Tensor.mul_: torch.Tensor.mul}
_INT32_RANGE = (-2**31, 2**31 - 1)


def _typed_integer(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.int32, torch.int64)


def _python_integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer_op(func, args, kwargs):
    """The Triton result of an integer ``+``, ``-`` or ``*`` (None: not one)."""
    if func not in _INTEGER_OPS or kwargs or len(args) != 2:
        return None
    a, b = args
    if not all(_typed_integer(x) or _python_integer(x) for x in (a, b)):
        return None
    symbol, op = _INTEGER_OPS[func]
    typed = [x.dtype for x in (a, b) if isinstance(x, torch.Tensor)]
    dtype = torch.int64 if torch.int64 in typed else torch.int32
    exact = op(*(x.to(torch.int64) if isinstance(x, torch.Tensor) else x for x in (a, b)))
    if dtype == torch.int32:
        lo, hi = _INT32_RANGE
        bad = (exact < lo) | (exact > hi)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()

            def at(x):
                if not isinstance(x, torch.Tensor) or x.dim() == 0:
                    return int(x)
                return int(x.expand(bad.shape)[first])

            value = int(exact.expand(bad.shape)[first]) if bad.dim() else int(exact)
            where = f" at index {first}" if first else ""
            raise Overflow(f"int32 overflow{where}: {at(args[0])} {symbol} {at(args[1])} = "
                           f"{value} (operands {', '.join(_describe(x) for x in (a, b))}); "
                           "an offset that may pass 2^31 needs int64")
    return exact.to(dtype)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    return "constant"


class _Integers(TorchFunctionMode):
    """Triton's integer arithmetic for the kernel's code (see :func:`_integer_op`)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        found = _integer_op(_IN_PLACE.get(func, func), args, kwargs)
        if found is None:
            return func(*args, **(kwargs or {}))
        if func in _IN_PLACE and found.dtype == args[0].dtype:
            return args[0].copy_(found)
        return found


def _kernel_scalar(v):
    """A kernel's integer argument as Triton types it: 1 is specialized into a constant, others
    are int32 when they fit, else int64 (0-d tensors, so that the arithmetic on them is
    Triton's)."""
    if not _python_integer(v) or v == 1:
        return v
    lo, hi = _INT32_RANGE
    return torch.tensor(v, dtype=torch.int32 if lo <= v <= hi else torch.int64)


# --- memory ----------------------------------------------------------------------------------


class _PtrType:
    def __init__(self, element_ty):
        self.element_ty = element_ty


class Ptr:
    """A pointer (or a tensor of pointers): a flat view of a tensor's storage from its first
    element, and element offsets."""

    def __init__(self, mem: torch.Tensor, offset, name: str = "?"):
        self.mem, self.offset, self.name = mem, offset, name

    @classmethod
    def of(cls, t: torch.Tensor, name: str) -> Ptr:
        n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
        flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), (n,))
        return cls(flat, 0, name)

    @property
    def dtype(self):
        return _PtrType(self.mem.dtype)

    def __add__(self, other):
        if isinstance(other, Ptr):
            raise TypeError("pointer + pointer")
        return Ptr(self.mem, _as_offset(self.offset) + _as_offset(other), self.name)

    __radd__ = __add__


def _as_offset(x):
    return x if isinstance(x, int) else torch.as_tensor(x).to(torch.int64)


def _addresses(ptr: Ptr, mask, like=None):
    off = torch.as_tensor(ptr.offset, dtype=torch.int64)
    parts = [off] + ([torch.as_tensor(mask)] if mask is not None else []) + (
        [like] if like is not None else [])
    shape = torch.broadcast_shapes(*(p.shape for p in parts))
    off = off.expand(shape)
    m = torch.ones(shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).expand(shape)
    bad = m & ((off < 0) | (off >= ptr.mem.numel()))
    if bool(bad.any()):
        raise ScheduleError(f"access outside {ptr.name}: offset {int(off[bad][0])} of "
                            f"{ptr.mem.numel()} elements")
    return off, m


def _poison_value(dtype):
    if dtype.is_floating_point:
        return float("nan")
    return {torch.int8: -128, torch.uint8: 255}.get(dtype, -1)


def _load(ptr, mask=None, other=None, **_):
    """Masked gather; masked-off lanes read ``other``, or poison where none is given."""
    off, m = _addresses(ptr, mask)
    mem = ptr.mem
    raw = mem.view(torch.uint8) if mem.dtype == torch.float8_e4m3fn else mem
    out = raw[off.clamp(0, max(mem.numel() - 1, 0))]
    if mem.dtype == torch.float8_e4m3fn:  # fill with bits: no torch.where on E4M3
        fill = torch.tensor(0x7F if other is None else other, dtype=torch.float32)
        fill = fill.to(mem.dtype).view(torch.uint8) if other is not None else fill.to(torch.uint8)
        return torch.where(m, out, fill).view(mem.dtype)
    fill = _poison_value(mem.dtype) if other is None else other
    return torch.where(m, out, torch.tensor(fill, dtype=out.dtype))


def _store(ptr, value, mask=None, **_):
    value = torch.as_tensor(value)
    off, m = _addresses(ptr, mask, like=value)
    value = value.expand(off.shape).to(ptr.mem.dtype)
    hit = off[m]
    # the offsets stored so far (not a flag per element: an output may be a view over a storage
    # of 2^31 elements and more, of which a launch writes a few)
    written = _machine().launch.written.get(id(ptr.mem), torch.zeros(0, dtype=torch.int64))
    unique, counts = torch.unique(hit, return_counts=True)
    twice = unique[(counts > 1) | torch.isin(unique, written)]
    if len(twice):
        raise Race(f"element {int(twice[0])} of {ptr.name} is stored twice in one launch")
    _machine().launch.written[id(ptr.mem)] = torch.cat([written, unique])
    ptr.mem[hit] = value[m]


class _Barrier:
    """An mbarrier: a phase completes when its arrivals reach ``count`` and every transaction byte
    expected in it has landed; arrivals after that count towards the next phase."""

    def __init__(self, name):
        self.name = name
        self.count = None  # set by init
        self.arrivals = 0
        self.tx = 0
        self.completed = 0  # phases completed; the current phase's parity is completed & 1
        self.loads = []  # (buffer view, data, bytes) issued, not landed
        self.ops = []  # tcgen05 operations that arrive on it when they complete
        self.release = Counter()  # what the arrivals of the current phase had seen
        self.clock = Counter()  # what the last completed phase tells the partitions that wait it

    def phase_done(self, parity: int) -> bool:
        """``wait(bar, parity)``'s test: has the latest phase of that parity completed?"""
        return (self.completed & 1) != parity

    def arrive(self, by: _Partition, count: int, tx: int = 0):
        if self.count is None:
            raise ScheduleError(f"arrival on {self.name}, never initialised")
        by.tick()
        _join(self.release, by.seen)
        self.arrivals += count
        self.tx += tx
        if self.arrivals > self.count:
            raise ScheduleError(f"{self.name}: {self.arrivals} arrivals in one phase of a barrier "
                                f"initialised with count {self.count}")
        self.try_complete()

    def land(self, pid):
        """Every TMA load issued on this barrier lands (the latest it may: at a wait on it)."""
        for view, data, _ in self.loads:
            view.tensor.copy_(data)
            view.root.loading.pop(view.key, None)
            view.root.tma_phase[view.key] = (self, self.completed + 1)
            self.tx -= data.numel() * data.element_size()
        self.loads = []
        if self.tx < 0:
            raise ScheduleError(f"program {pid}: {self.name} received {-self.tx} bytes more than "
                                "its expect() announced (a load signals the wrong barrier)")

    def complete_ops(self):
        """The tcgen05 operations that signal this barrier complete (the latest they may: at a
        wait on it), each with every operation issued before it by the same partition."""
        while self.ops:
            _complete(self.ops[0])

    def try_complete(self):
        if self.arrivals >= self.count and self.tx == 0 and not self.loads:
            self.completed += 1
            self.arrivals -= self.count
            self.clock = _join(self.release, {self: self.completed})
            self.release = Counter()

    def state(self) -> str:
        return f"{self.arrivals} of {self.count} arrivals, {self.tx} bytes outstanding"


class _View:
    """A buffer (shared or tensor memory) or a view of one; hazards are tracked per root buffer
    and index path (``key``)."""

    def __init__(self, tensor, root, key=()):
        self.tensor, self.root, self.key = tensor, root, key

    @property
    def shape(self):
        return list(self.tensor.shape)

    @property
    def dtype(self):
        return self.tensor.dtype

    def index(self, i):
        i = int(i)
        if not 0 <= i < self.tensor.shape[0]:
            raise ScheduleError(f"{self.root.name}.index({i}) of {self.tensor.shape[0]}")
        return type(self)(self.tensor[i], self.root, self.key + (i,))

    def where(self):
        return f"{self.root.name}{list(self.key)}"


class _Shared(_View):
    """A shared-memory buffer or a view of one (``index``, ``permute``)."""

    def __init__(self, tensor, root=None, key=(), name="smem"):
        super().__init__(tensor, root if root is not None else _Root(name), key)

    def permute(self, order):
        return _Shared(self.tensor.permute(*order), self.root, self.key)

    def slice(self, start, length, dim=0):
        start, length, dim = int(start), int(length), int(dim)
        if start < 0 or start + length > self.tensor.shape[dim]:
            raise ScheduleError(f"{self.where()}.slice({start}, {length}, dim={dim}) of "
                                f"{self.tensor.shape[dim]}")
        return _Shared(self.tensor.narrow(dim, start, length), self.root,
                       self.key + ((f"dim{dim}", start, start + length),))

    def store(self, value):
        machine = _machine()
        machine.check_no_reader(self, "a store into")
        machine.check_no_load(self, "a store into")
        if list(value.shape) != self.shape or value.dtype != self.dtype:
            raise ScheduleError(f"store of {value.dtype}{list(value.shape)} into "
                                f"{self.where()}: {self.dtype}{self.shape}")
        machine.check_ordered_write(self, "a store into")
        self.tensor.copy_(value)
        self.root.unfenced.add((machine.current, self.key))
        self.root.stored_by[(self.key, machine.current)] = machine.current.tick()

    def load(self, layout=None):
        machine = _machine()
        machine.check_no_load(self, "a load from")
        machine.check_ordered_read(self, "a load from")
        return self.tensor.clone()


class _Root:
    def __init__(self, name):
        self.name = name
        self.loading = {}  # key -> barrier of a TMA load not yet landed
        self.unfenced = set()  # (partition, key) stored by the generic proxy, not yet fenced
        self.barriers = {}
        # for the happens-before checks between partitions: the last access to each key
        self.tma_phase = {}  # key -> (barrier, phase number) in which its last TMA load landed
        self.read_by = {}  # (key, partition) -> partition's time when a wgmma reading it retired
        self.stored_by = {}  # (key, partition) -> partition's time at its last store


def _join(clock: Counter, other) -> Counter:
    """``clock`` raised to at least ``other`` in every entry (a vector clock's join)."""
    for actor, t in other.items():
        if clock[actor] < t:
            clock[actor] = t
    return clock


def _overlap(a, b):
    """Whether two index paths (from one root) share an element: equal along their common
    prefix, where a slice ``(kind, start, stop)`` (tensor memory's columns ``"cols"``, shared
    memory's dimension ``d`` ``"dim<d>"``) meets another of its kind when the ranges intersect."""
    for x, y in zip(a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):
            if x[0] == y[0] and (x[2] <= y[1] or y[2] <= x[1]):
                return False
        elif isinstance(x, tuple) or isinstance(y, tuple):
            return True  # an index against a slice: not made by the kernels modelled; be strict
        elif x != y:
            return False
    return True


@dataclasses.dataclass
class _Group:
    result: torch.Tensor
    reads: list
    done: bool = False


class _Token:
    """An asynchronous wgmma's result: usable only through ``warpgroup_mma_wait``."""

    def __init__(self, group):
        self.group = group


@dataclasses.dataclass
class Trace:
    """What the launches did, summed over programs: counts of events, and of calls to each
    ``@jit`` function with its constexpr arguments."""

    events: Counter = dataclasses.field(default_factory=Counter)
    calls: Counter = dataclasses.field(default_factory=Counter)


SCHEDULES = ("lazy", "eager", "reverse")


class _Launch:
    def __init__(self, trace, schedule="lazy", num_warps=4):
        self.trace = trace
        self.schedule, self.num_warps = schedule, num_warps
        self.written = {}


class _Stop(BaseException):
    """Unwinds a partition's thread once another partition has failed."""


class _Partition:
    """The warps that run one function: the whole program outside ``warp_specialize``, one
    partition inside it. Owns its wgmma groups in flight; while blocked in an mbarrier wait it
    holds ``waiting = (can_go, what)``."""

    def __init__(self, name, num_warps):
        self.name, self.num_warps = name, num_warps
        self.inflight: list[_Group] = []
        self.tcgen05: list[_TcOp] = []  # its tcgen05 operations not completed, in issue order
        self.unit = _Unit(self)  # the tensor core completing them (an actor of the clocks)
        self.waiting = None
        self.finished = False
        self.turn = threading.Semaphore(0)  # released to let this partition's thread run
        # a vector clock: for each partition (and each barrier, whose time is its number of
        # completed phases) the latest of its events known to have happened before now
        self.seen = Counter()

    def tick(self) -> int:
        self.seen[self] += 1
        return self.seen[self]


class _Unit:
    """The tensor core as it completes one partition's tcgen05 operations (in issue order): an
    actor of the vector clocks, whose time counts its completions."""

    def __init__(self, partition):
        self.partition = partition
        self.seen = Counter()

    @property
    def name(self):
        return f"the tcgen05 operations of {self.partition.name}"

    def tick(self) -> int:
        self.seen[self] += 1
        return self.seen[self]


class _Machine:
    """One program (CTA): its shared memory, barriers and partitions. Inside ``warp_specialize``
    each partition is a thread, and exactly one runs at a time: the running one hands the CPU
    over only at a synchronisation point (:meth:`sync`) or when it blocks (:meth:`block`)."""

    def __init__(self, pid, launch):
        self.pid, self.launch = pid, launch
        self.main = _Partition("default", launch.num_warps)
        self.current = self.main
        self.partitions = [self.main]  # those running now: one outside warp_specialize
        self.every_partition = [self.main]
        self.roots: list[_Root] = []
        self.barriers: list[_Barrier] = []
        self.failure = None  # (partition, exception) that stops a warp_specialize
        self.done = threading.Event()

    def event(self, name, n=1):
        self.launch.trace.events[name] += n

    def check_no_reader(self, view, what):
        for p in self.every_partition:
            for g in p.inflight:
                for r in g.reads:
                    if r.root is view.root and _overlap(r.key, view.key):
                        by = f" (issued by {p.name})" if len(self.every_partition) > 1 else ""
                        raise Race(f"{what} {view.where()} while a wgmma that reads it is in "
                                   f"flight{by}")
        self._check_tcgen05(view, what, "reads")

    def check_no_writer(self, view, what, skip=None):
        """No tcgen05 operation (of a partition other than ``skip``) that writes ``view`` is still
        to complete."""
        self._check_tcgen05(view, what, "writes", skip)

    def _check_tcgen05(self, view, what, access, skip=None):
        for p in self.every_partition:
            if p is skip:
                continue
            for op in p.tcgen05:
                for r in getattr(op, access):
                    if r.root is view.root and _overlap(r.key, view.key):
                        raise Race(f"{what} {view.where()} while a {op.kind} issued by {p.name} "
                                   f"that {access[:-1]}s it has not completed (no wait on its "
                                   "barrier)")

    # happens-before between partitions (inside warp_specialize; one thread is in program order)

    def check_ordered_read(self, view, what, also=None):
        """Reading ``view``: its TMA load's phase must have been waited for, and another
        partition's store into it must reach this one through barriers (``also``: an actor that
        counts as this one, the partition's own tensor core for its tcgen05 operations)."""
        if len(self.partitions) == 1:
            return
        p = self.current
        for key, (bar, phase) in view.root.tma_phase.items():
            if _overlap(key, view.key) and p.seen[bar] < phase:
                raise Race(f"{what} {view.where()} by {p.name}: its TMA load completes phase "
                           f"{phase - 1} of {bar.name}, which {p.name} has not waited for")
        self._check_stores(view, what, also)

    def check_ordered_write(self, view, what, also=None):
        """Writing ``view`` (a TMA load issued, a store): every other partition's wgmma reading it
        must have retired, and its retirement reached this partition through barriers; so must
        its last TMA load and other partitions' stores."""
        if len(self.partitions) == 1:
            return
        p = self.current
        for (key, q), t in view.root.read_by.items():
            if q is not p and q is not also and _overlap(key, view.key) and p.seen[q] < t:
                raise Race(f"{what} {view.where()} by {p.name} is not ordered after the "
                           f"retirement of {q.name}'s wgmma that reads it (no barrier in between)"
                           if isinstance(q, _Partition) and view.root.name.startswith("smem") else
                           f"{what} {view.where()} by {p.name} is not ordered after a read of it "
                           f"by {q.name} (no barrier in between)")
        self.check_ordered_read(view, what, also)

    def _check_stores(self, view, what, also=None):
        p = self.current
        for (key, q), t in view.root.stored_by.items():
            if q is not p and q is not also and _overlap(key, view.key) and p.seen[q] < t:
                raise Race(f"{what} {view.where()} by {p.name} is not ordered after {q.name}'s "
                           "store into it (no barrier in between)")

    # scheduling the partitions of a warp_specialize

    def _order(self, after):
        """The partitions in the policy's round-robin order, starting after ``after`` (which
        comes last); "reverse" goes round the other way."""
        ps = self.partitions[::-1] if self.launch.schedule == "reverse" else self.partitions
        i = ps.index(after)
        return ps[i + 1:] + ps[:i + 1]

    @staticmethod
    def _can_run(p) -> bool:
        return not p.finished and (p.waiting is None or p.waiting[0]())

    def _next(self, after):
        return next((p for p in self._order(after) if self._can_run(p)), None)

    def _switch(self, nxt):
        p = self.current
        if nxt is p:
            return
        self.event("partition switches")
        self.current = nxt
        nxt.turn.release()
        p.turn.acquire()
        if self.failure is not None:
            raise _Stop

    def sync(self):
        """A synchronisation point of the running partition: under "eager" the next partition
        that can run takes over (round robin); otherwise the running one goes on."""
        if len(self.partitions) > 1 and self.launch.schedule == "eager":
            self._switch(self._next(self.current))

    def block(self, can_go, what):
        """Wait until ``can_go()`` (which may land loads and complete phases) holds, letting the
        other partitions run; :class:`Hang` when no partition can run."""
        p = self.current
        p.waiting = (can_go, what)
        nxt = self._next(p)
        if nxt is None:
            raise self._hang()
        self._switch(nxt)
        p.waiting = None

    def _hang(self) -> Hang:
        if len(self.partitions) == 1:
            return Hang(f"program {self.pid}: {self.current.waiting[1]()} never returns")
        states = [f"{p.name} finished" if p.finished else f"{p.name} blocked in {p.waiting[1]()}"
                  for p in self.partitions]
        hang = Hang(f"program {self.pid}: every partition is blocked: " + "; ".join(states))
        hang.names_every_partition = True
        return hang

    def specialize(self, functions_and_args, worker_num_warps):
        """Run the partitions to the end; the default partition's return value. The program's
        own partition is the default one (same warps, same wgmma groups and fences)."""
        if len(self.partitions) > 1:
            raise NotModeled("warp_specialize inside a warp-specialized partition")
        main = self.main
        main.turn, main.finished, main.waiting = threading.Semaphore(0), False, None
        workers = [_Partition(f"worker {i}", w) for i, w in enumerate(worker_num_warps)]
        for w in workers:
            _join(w.seen, main.seen)  # the fork: workers start after what the program did
        self.partitions = [main] + workers
        self.every_partition += workers
        for p, (fn, _) in zip(self.partitions, functions_and_args):
            p.name = f"{p.name.split(' (')[0]} ({getattr(fn, '__name__', fn)})"
        results = self._run_threads(functions_and_args)
        self.partitions, self.current = [main], main
        for w in workers:
            _join(main.seen, w.seen)  # the join: what follows comes after every partition
        if self.failure is not None:
            raise _named(*self.failure)
        value = results.get("default")
        if value is not None and not isinstance(value, tuple):
            raise ScheduleError(f"the default partition {main.name} returns a "
                                f"{type(value).__name__}: Gluon's warp_specialize takes a tuple "
                                "(or nothing) and returns it")
        return value

    def _run_threads(self, functions_and_args) -> dict:
        """One thread per partition; the first to run is the policy's; returns when every
        partition has finished or one has failed (``self.failure``)."""
        self.failure, results = None, {}
        self.done.clear()
        threads = [threading.Thread(target=self._run, args=(p, fn, tuple(args), results),
                                    name=f"gluon_cpu {p.name}", daemon=True)
                   for p, (fn, args) in zip(self.partitions, functions_and_args)]
        for t in threads:
            t.start()
        self.current = self.partitions[-1 if self.launch.schedule == "reverse" else 0]
        self.current.turn.release()
        self.done.wait()
        for t in threads:
            t.join()
        return results

    def _run(self, p, fn, args, results):
        p.turn.acquire()
        try:
            if self.failure is not None:
                return
            with _Integers():  # a mode is per thread
                value = fn(*args)
            if p is self.main:
                results["default"] = value
            p.finished = True
            nxt = self._next(p)
            if nxt is None:
                if not all(q.finished for q in self.partitions):
                    raise self._hang()
                self.done.set()
                return
            self.current = nxt
            nxt.turn.release()
        except _Stop:
            return
        except BaseException as e:  # noqa: BLE001 - re-raised by the launching thread
            self.failure = (p, e)
            for q in self.partitions:
                if q is not p:
                    q.turn.release()
            self.done.set()

    def check_no_load(self, view, what):
        for key, bar in view.root.loading.items():
            if _overlap(key, view.key):
                raise Race(f"{what} {view.where()} while its TMA load (barrier {bar.name}) has "
                           "not been waited for")

    def finish(self):
        for p in self.every_partition:
            if p.inflight:
                of = f" of {p.name}" if len(self.every_partition) > 1 else ""
                raise ScheduleError(f"program {self.pid} ends with {len(p.inflight)} wgmma "
                                    f"group(s){of} never waited for")
            if p.tcgen05:
                raise ScheduleError(f"program {self.pid} ends with {len(p.tcgen05)} tcgen05 "
                                    f"operation(s) of {p.name} whose completion no wait observed "
                                    f"(first: {p.tcgen05[0].kind})")
        for bar in self.barriers:
            if bar.loads or bar.tx:
                raise ScheduleError(f"program {self.pid} ends with a TMA load on {bar.name} never "
                                    "waited for")


def _named(p: _Partition, e: BaseException) -> BaseException:
    """``e``, raised in partition ``p``, to re-raise in the launching thread, naming ``p``."""
    if getattr(e, "names_every_partition", False):
        return e
    if isinstance(e, ScheduleError):
        named = type(e)(f"{p.name}: {e}")
        named.__cause__ = e
        return named
    e.add_note(f"raised in the warp-specialized partition {p.name}")
    return e


_CURRENT: list[_Machine] = []


def _machine() -> _Machine:
    return _CURRENT[-1]


# --- the language ----------------------------------------------------------------------------


def _t(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _cdiv(x, d):
    return torch.div(_t(x) + (d - 1), d, rounding_mode="trunc")


class _Layout:
    """Any layout: recorded, never used."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    @classmethod
    def get_default_for(cls, *args, **kwargs):
        return cls(*args, **kwargs)


class _BarrierLayout(_Layout):
    pass


def _allocate_shared_memory(element_ty, shape, layout, value=None):
    """A fresh buffer, poisoned (NaN E4M3, -128 INT8, NaN floats); barriers: ``bar<n>``."""
    m = _machine()
    if isinstance(layout, _BarrierLayout):
        root = _Root(f"bar{len(m.roots)}")
        t = torch.zeros(shape, dtype=torch.int64)
    else:
        root = _Root(f"smem{len(m.roots)}")
        if element_ty == torch.float8_e4m3fn:
            t = torch.full(shape, 0x7F, dtype=torch.uint8).view(element_ty)
        else:
            t = torch.full(shape, _poison_value(element_ty), dtype=element_ty)
    view = _Shared(t, root)
    if value is not None:
        view.store(value)
    m.roots.append(root)
    return view


def _barrier(view: _Shared) -> _Barrier:
    if view.tensor.dim() != 1 or view.tensor.shape[0] != 1:
        raise ScheduleError(f"{view.where()} is not one mbarrier")
    bars = view.root.barriers
    if view.key not in bars:
        bars[view.key] = _Barrier(view.where())
        _machine().barriers.append(bars[view.key])
    return bars[view.key]


class _Namespace:
    """A stand-in for a language module: unknown names raise :class:`NotModeled` when used."""

    def __init__(self, real_name, **names):
        self._real_name = real_name
        self.__dict__.update(names)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotModeled(f"{self._real_name}.{name} is not modelled by lowbit_attn.tools.gluon_cpu")

    def modeled(self):
        return {k for k in self.__dict__ if not k.startswith("_")}


def _make_lang(real_name, numerics):
    def fma(a, b, c):
        if numerics.fused_fma:
            return (_t(a).double() * _t(b).double() + _t(c).double()).float()
        return a * b + c

    def where(c, a, b):
        return torch.where(_t(c), a, b)

    def program_id(axis):
        return torch.tensor(_machine().pid[axis], dtype=torch.int32)

    def full(shape, value, dtype, layout=None):
        return torch.full(list(shape), value, dtype=dtype)

    def zeros(shape, dtype, layout=None):
        return torch.zeros(list(shape), dtype=dtype)

    def arange(start, end, layout=None):
        return torch.arange(start, end, dtype=torch.int32)

    def max_(x, axis):
        return torch.amax(x, dim=axis)

    def reduce(x, axis, combine_fn, keep_dims=False):
        """Any reduction, folding ``combine_fn`` along ``axis`` in index order."""
        x = _t(x)
        out = x.select(axis, 0)
        for j in range(1, x.shape[axis]):
            out = combine_fn(out, x.select(axis, j))
        return out.unsqueeze(axis) if keep_dims else out

    def sum_(x, axis):
        return row_sum(x, axis)

    names = dict(
        program_id=program_id, arange=arange, full=full, zeros=zeros, load=_load, store=_store,
        exp2=exp2, log2=log2, abs=torch.abs, fma=fma, where=where,
        maximum=lambda a, b, propagate_nan=None: torch.maximum(_t(a), _t(b)),
        minimum=lambda a, b, propagate_nan=None: torch.minimum(_t(a), _t(b)),
        max=max_, sum=sum_, reduce=reduce, cdiv=_cdiv, static_range=range, constexpr=lambda v: v,
        div_rn=lambda a, b: torch.div(_t(a), _t(b)),
        convert_layout=lambda x, layout, assert_trivial=False: x,
        float32=torch.float32, int8=torch.int8, int32=torch.int32, int64=torch.int64,
        uint8=torch.uint8, float8e4nv=torch.float8_e4m3fn, float16=torch.float16,
        bfloat16=torch.bfloat16,
    )
    if real_name == "gl":
        names.update(
            allocate_shared_memory=_allocate_shared_memory, NVMMADistributedLayout=_Layout,
            SliceLayout=_Layout, NVMMASharedLayout=_Layout, BlockedLayout=_Layout,
            SharedLinearLayout=_Layout, DotOperandLayout=_Layout,
            DistributedLinearLayout=_Layout, split=_split,
            join=lambda a, b: torch.stack(torch.broadcast_tensors(_t(a), _t(b)), -1),
            inline_asm_elementwise=_inline_asm_elementwise,
            reshape=lambda x, shape, can_reorder=False: x.reshape(list(shape)),
            permute=lambda x, dims: x.permute(*dims),
            broadcast=lambda a, b: torch.broadcast_tensors(_t(a), _t(b)),
            expand_dims=lambda x, axis: x.unsqueeze(axis),
            warp_specialize=_warp_specialize, num_warps=lambda: _machine().current.num_warps,
            thread_barrier=lambda: None, barrier=lambda cluster=False: None,
        )
    return _Namespace(real_name, **names)


# mbarrier, TMA, wgmma


def _mb_init(bar, count):
    b = _barrier(bar)
    b.count, b.arrivals, b.tx, b.completed, b.loads, b.ops = count, 0, 0, 0, [], []


def _mb_expect(bar, bytes, pred=True):
    """An arrival that also announces ``bytes`` of TMA transactions."""
    if not bool(pred):
        return
    m = _machine()
    _barrier(bar).arrive(m.current, 1, int(bytes))
    m.sync()


def _mb_arrive(bar, *, count=1, pred=True):
    if bool(pred):
        m = _machine()
        _barrier(bar).arrive(m.current, int(count))
        m.sync()


def _mb_wait(bar, phase, pred=True, deps=()):
    """Returns at once when the phase of parity ``phase`` has completed; otherwise the loads on
    the barrier land and, if the phase still cannot complete, the partition blocks."""
    if not bool(pred):
        return
    b = _barrier(bar)
    if b.count is None:
        raise ScheduleError(f"wait on {b.name}, never initialised")
    parity = int(phase)
    m = _machine()
    m.sync()
    if b.phase_done(parity):
        m.event("wait returned at once")
        _join(m.current.seen, b.clock)
        return

    def can_go():
        b.land(m.pid)
        b.complete_ops()
        b.try_complete()
        return b.phase_done(parity)

    if not can_go():
        m.block(can_go, lambda: f"wait({b.name}, phase {parity}) with {b.state()}")
    _join(m.current.seen, b.clock)
    m.event(f"wait phase {parity}")


def _mb_invalidate(bar):
    b = _barrier(bar)
    if b.loads or b.tx or b.arrivals or b.ops:
        raise ScheduleError(f"{b.name} invalidated with a load or an arrival pending")
    b.count = None


@dataclasses.dataclass
class _BlockType:
    nbytes: int


@dataclasses.dataclass
class _Descriptor:
    base: Ptr
    shape: list
    strides: list
    block_shape: list
    layout: object = None

    @property
    def dtype(self):
        return self.base.mem.dtype

    @property
    def block_type(self):
        n = 1
        for s in self.block_shape:
            n *= s
        return _BlockType(n * self.base.mem.element_size())


def _make_tensor_descriptor(base, shape, strides, block_shape, layout, padding_option="zero"):
    strides = [int(s) for s in strides]
    if strides[-1] != 1:
        raise ScheduleError(f"TMA descriptor over {base.name} with inner stride {strides[-1]}")
    size = base.mem.element_size()
    address = base.mem.data_ptr() + int(base.offset) * size
    if address % 16 or any(s * size % 16 for s in strides[:-1]):
        raise ScheduleError(f"TMA descriptor over {base.name}: global address {address:#x} and "
                            f"strides {strides} (elements of {size} B) must be 16-byte aligned")
    return _Descriptor(base, [int(s) for s in shape], strides, [int(s) for s in block_shape],
                       layout)


def _async_copy_global_to_shared(desc, coord, barrier, result, pred=True):
    m = _machine()
    if not bool(pred):
        m.event("tma skipped")
        return
    if result.shape != desc.block_shape or result.dtype != desc.base.mem.dtype:
        raise ScheduleError(f"TMA box {desc.block_shape} of {desc.base.mem.dtype} into "
                            f"{result.where()}: {result.dtype}{result.shape}")
    m.check_no_reader(result, "a TMA load into")
    m.check_no_load(result, "a TMA load into")
    m.check_ordered_write(result, "a TMA load into")
    idx = [int(c) + torch.arange(n) for c, n in zip(coord, desc.block_shape)]
    grids = torch.meshgrid(*idx, indexing="ij")
    inside = torch.ones(grids[0].shape, dtype=torch.bool)
    off = torch.as_tensor(desc.base.offset, dtype=torch.int64)
    for g, n, s in zip(grids, desc.shape, desc.strides):
        inside &= (g >= 0) & (g < n)
        off = off + g * s
    data = _load(Ptr(desc.base.mem, off, desc.base.name), mask=inside, other=0)
    b = _barrier(barrier)
    b.loads.append((result, data, None))
    result.root.loading[result.key] = b
    m.event("tma")
    m.event("tma zero-filled elements", int((~inside).sum()))
    m.sync()


def _fence_async_shared(cluster=False):
    """Orders the calling partition's own shared-memory stores before later async reads."""
    m = _machine()
    for root in m.roots:
        root.unfenced = {(p, key) for p, key in root.unfenced if p is not m.current}


def _operand(x, m):
    if isinstance(x, _Shared):
        m.check_no_load(x, "a wgmma reading")
        m.check_ordered_read(x, "a wgmma reading")
        for p, key in x.root.unfenced:
            if _overlap(key, x.key):
                by = "" if p is m.current else f" by {p.name}"
                raise Race(f"a wgmma reads {x.where()}, stored{by} without fence_async_shared")
        return x.tensor
    if isinstance(x, _Token):
        raise Race("a wgmma reads the result of a wgmma still in flight")
    return x


def _retired(m, reads):
    """The running partition's wgmma that read ``reads`` has retired: noted for the
    happens-before check of a later write."""
    now = m.current.tick()
    for r in reads:
        r.root.read_by[(r.key, m.current)] = now


def _warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None,
                   is_async=False):
    m = _machine()
    av, bv, cv = _operand(a, m), _operand(b, m), _operand(acc, m)
    if av.shape[1] != bv.shape[0] or list(cv.shape) != [av.shape[0], bv.shape[1]]:
        raise ScheduleError(f"wgmma of {list(av.shape)}·{list(bv.shape)} into {list(cv.shape)}")
    prod = av.double().contiguous() @ bv.double().contiguous()
    if use_acc:
        prod = prod + cv.double()
    result = prod.to(cv.dtype)
    m.event("wgmma")
    if not is_async:
        _retired(m, [x for x in (a, b) if isinstance(x, _Shared)])
        return result
    group = _Group(result, [x for x in (a, b) if isinstance(x, _Shared)])
    m.current.inflight.append(group)
    m.sync()
    return _Token(group)


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Retires the calling partition's oldest groups until ``num_outstanding`` remain."""
    m = _machine()
    inflight = m.current.inflight
    while len(inflight) > int(num_outstanding):
        group = inflight.pop(0)
        group.done = True
        _retired(m, group.reads)
    m.sync()
    out = []
    for d in deps:
        if isinstance(d, _Token):
            if not d.group.done:
                raise Race("a wgmma's result is read before the wait that retires it")
            out.append(d.group.result)
        else:
            out.append(d)
    return out[0] if len(out) == 1 else tuple(out)


# --- Blackwell: tensor memory, tcgen05 ------------------------------------------------------


class _TMem(_View):
    """Tensor memory (an allocation or a view: ``index``, ``slice`` of columns): logical tiles,
    scales as ``[rows, K/group]``. A generic ``load`` or ``store`` waits for nothing: a tcgen05
    operation writing (or, for a store, reading) it must have completed, and another
    partition's accesses must be ordered through barriers."""

    def slice(self, start, length):
        start, length = int(start), int(length)
        if start < 0 or start + length > self.tensor.shape[-1]:
            raise ScheduleError(f"{self.where()}.slice({start}, {length}) of "
                                f"{self.tensor.shape[-1]} columns")
        return _TMem(self.tensor[..., start:start + length], self.root,
                     self.key + (("cols", start, start + length),))

    def load(self, layout=None):
        m = _machine()
        m.check_no_writer(self, "a load from")
        m.check_ordered_read(self, "a load from")
        if len(m.partitions) > 1:  # a generic read: later writers must be ordered after it
            self.root.read_by[(self.key, m.current)] = m.current.tick()
        return self.tensor.clone()

    def store(self, value, pred=True):
        if not bool(pred):
            return
        m = _machine()
        value = _t(value)
        if list(value.shape) != self.shape or value.dtype != self.dtype:
            raise ScheduleError(f"store of {value.dtype}{list(value.shape)} into "
                                f"{self.where()}: {self.dtype}{self.shape}")
        m.check_no_reader(self, "a store into")
        m.check_no_writer(self, "a store into")
        m.check_ordered_write(self, "a store into")
        self.tensor.copy_(value)
        self.root.stored_by[(self.key, m.current)] = m.current.tick()

    def _reinterpret(self, *args, **kwargs):
        raise NotModeled("tensor_memory_descriptor._reinterpret is not modelled")


def _allocate_tensor_memory(element_ty, shape, layout, value=None):
    """A fresh allocation, poisoned (NaN floats and E4M3, 255 = NaN E8M0 bytes)."""
    m = _machine()
    if element_ty == torch.float8_e4m3fn:
        t = torch.full(list(shape), 0x7F, dtype=torch.uint8).view(element_ty)
    elif element_ty == torch.uint8:
        t = torch.full(list(shape), 255, dtype=torch.uint8)
    else:
        t = torch.full(list(shape), _poison_value(element_ty), dtype=element_ty)
    root = _Root(f"tmem{len(m.roots)}")
    m.roots.append(root)
    view = _TMem(t, root)
    if value is not None:
        view.store(value)
    return view


@dataclasses.dataclass
class _TcOp:
    """A tcgen05 operation issued, not completed: its result is already in place (computed at
    issue from the operands as they were), what it reads and writes stays claimed until it
    completes, and then it arrives on ``barriers``."""

    kind: str
    issuer: _Partition
    reads: list
    writes: list
    barriers: list
    clock: Counter


def _complete(op: _TcOp):
    """``op`` completes, after every tcgen05 operation its partition issued before it."""
    pending = op.issuer.tcgen05
    unit = op.issuer.unit
    while pending:
        first = pending.pop(0)
        _join(unit.seen, first.clock)
        now = unit.tick()
        for r in first.reads:
            r.root.read_by[(r.key, unit)] = now
        for w in first.writes:
            w.root.stored_by[(w.key, unit)] = now
        for b in first.barriers:
            b.ops.remove(first)
            b.arrive(unit, 1)
        _machine().event(f"{first.kind} completed")
        if first is op:
            return


def _issue(kind, reads, writes, barriers):
    m = _machine()
    p = m.current
    p.tick()
    op = _TcOp(kind, p, reads, writes, [_barrier(b) for b in barriers], Counter(p.seen))
    p.tcgen05.append(op)
    for b in op.barriers:
        if b.count is None:
            raise ScheduleError(f"a {kind} signals {b.name}, never initialised")
        b.ops.append(op)
    m.event(kind)
    if not barriers and kind != "tcgen05_copy":  # synchronous
        _complete(op)
    m.sync()


def _async_read(x, m, what):
    """An operand the tensor core reads: shared memory filled (TMA waited for, stores fenced),
    tensor memory not being written by another partition's operation; both ordered after other
    partitions' stores."""
    if isinstance(x, _Shared):
        m.check_no_load(x, what)
        m.check_ordered_read(x, what)
        for p, key in x.root.unfenced:
            if _overlap(key, x.key):
                by = "" if p is m.current else f" by {p.name}"
                raise Race(f"{what} {x.where()}, stored{by} without fence_async_shared")
    elif isinstance(x, _TMem):
        m.check_no_writer(x, what, skip=m.current)
        m.check_ordered_read(x, what, also=m.current.unit)
    else:
        raise ScheduleError(f"{what} a {type(x).__name__}: tcgen05 operands are shared or tensor "
                            "memory")
    return x.tensor


def _async_write(x, m, what):
    """The tensor core's destination: no other partition's pending operation reads or writes it,
    and every other partition's access to it is ordered before (through barriers)."""
    if not isinstance(x, _TMem):
        raise ScheduleError(f"{what} {type(x).__name__}: tcgen05 results go to tensor memory")
    for p in m.every_partition:
        if p is not m.current:
            for op in p.tcgen05:
                for r in op.reads + op.writes:
                    if r.root is x.root and _overlap(r.key, x.key):
                        raise Race(f"{what} {x.where()} while a {op.kind} of {p.name} that uses "
                                   "it has not completed")
    m.check_ordered_write(x, what, also=m.current.unit)


_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def _e2m1_values(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """E2M1 bytes, K packed along ``dim`` (element ``2i`` in the low nibble) → float64 values."""
    if packed.dtype != torch.uint8:
        raise ScheduleError(f"an e2m1 operand of {packed.dtype}: E2M1 pairs are uint8")
    lo = _E2M1_VALUES[(packed & 0xF).long()]
    hi = _E2M1_VALUES[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=dim + 1).flatten(dim, dim + 1)


def _scale_values(scale: torch.Tensor, k: int, rows: int, what: str) -> torch.Tensor:
    """A scale tile ``[rows, K/group]`` → float64 factors ``[rows, K]``: E4M3 groups of 16
    (NVFP4, ``mxf4nvf4`` with ``scale_vec::4X``) or E8M0 bytes groups of 32 (MXFP4, ``mxf4``,
    ``scale_vec::2X``; 255 is NaN)."""
    if scale.dtype == torch.float8_e4m3fn:
        group, values = 16, scale.float().double()
    elif scale.dtype == torch.uint8:
        group = 32
        values = torch.where(scale == 255, float("nan"),
                             torch.exp2(scale.double() - 127.0))
    else:
        raise ScheduleError(f"{what} scales of {scale.dtype}: E4M3 or E8M0 (uint8) only")
    if list(scale.shape) != [rows, k // group]:
        raise ScheduleError(f"{what} scales {list(scale.shape)} for {rows} rows of K={k} in "
                            f"groups of {group}")
    return values.repeat_interleave(group, dim=1)


def _tcgen05_mma_scaled(a, b, acc, a_scale, b_scale, a_type, b_type, *, use_acc=True, pred=True,
                        mbarriers=None, mbarrier_preds=None):
    """``acc = (A·a_scale)(B·b_scale) (+ acc)``: the dequantized operands' product in float64,
    rounded once to fp32 (exact products; the sum is exact whenever it fits float64's 53 bits).
    ``a`` ``[M, K/2]`` and ``b`` ``[K/2, N]`` (a permuted K-major tile) E2M1 bytes in shared
    memory, scales ``[M, K/g]`` and ``[N, K/g]`` in tensor memory. Issued, not completed: it
    arrives on each of ``mbarriers`` when a wait on one of them needs it."""
    a_type, b_type = str(a_type), str(b_type)
    if (a_type, b_type) != ("e2m1", "e2m1"):
        raise NotModeled(f"tcgen05_mma_scaled of {a_type}·{b_type} (e2m1 only)")
    if not (isinstance(pred, bool) and pred) or mbarrier_preds is not None:
        raise NotModeled("tcgen05_mma_scaled with predicates")
    m = _machine()
    what = "a tcgen05_mma_scaled reading"
    av, bv = _async_read(a, m, what), _async_read(b, m, what)
    asv, bsv = _async_read(a_scale, m, what), _async_read(b_scale, m, what)
    reads = [a, b, a_scale, b_scale]
    if bool(use_acc):
        cv = _async_read(acc, m, what)
        reads.append(acc)
    _async_write(acc, m, "a tcgen05_mma_scaled into")
    x, y = _e2m1_values(av, 1), _e2m1_values(bv, 0)
    if x.shape[1] != y.shape[0] or acc.shape != [x.shape[0], y.shape[1]]:
        raise ScheduleError(f"tcgen05_mma_scaled of {list(x.shape)}·{list(y.shape)} into "
                            f"{acc.shape}")
    x = x * _scale_values(asv, x.shape[1], x.shape[0], "A's")
    y = y * _scale_values(bsv, y.shape[0], y.shape[1], "B's").T
    prod = x.contiguous() @ y.contiguous()
    if bool(use_acc):
        prod = prod + cv.double()
    acc.tensor.copy_(prod.to(acc.dtype))
    _issue("tcgen05_mma_scaled", reads, [acc], list(mbarriers or []))


def _tcgen05_copy(src, dst):
    """Shared → tensor memory, asynchronous; ordered before the partition's later tcgen05
    operations (it completes with the next one that completes), its source claimed until then."""
    m = _machine()
    data = _async_read(src, m, "a tcgen05_copy from")
    _async_write(dst, m, "a tcgen05_copy into")
    if data.shape != dst.tensor.shape or data.dtype != dst.dtype:
        raise ScheduleError(f"tcgen05_copy of {data.dtype}{list(data.shape)} into "
                            f"{dst.where()}: {dst.dtype}{dst.shape}")
    dst.tensor.copy_(data)
    _issue("tcgen05_copy", [src], [dst], [])


def _tcgen05_commit(barrier):
    """An arrival on ``barrier`` once every tcgen05 operation issued before it has completed."""
    _issue("tcgen05_commit", [], [], [barrier])


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    """Three conversions and a read of the grid index only. The hardware E2M1 conversion
    (``quant.fp4.E2M1X2_PTX``, four ``cvt.rn.satfinite.e2m1x2.f32``): byte ``i`` = ``code(lo_i) | code(hi_i) << 4`` with the
    twin's ``quant.fp4_naive.e2m1_code`` (its RNE and saturation are the instruction's for every
    non-NaN input: tests/quant/test_fp4.py; a NaN's code is the hardware's, not modelled). And the
    E4M3 one (``inference.gluon_blocks.E4M3X4_PTX``, ``cvt.rn.satfinite.e4m3x2.f32``): each
    element's E4M3 bits by the twin's ``quant.int8_naive.to_e4m3`` (round to nearest even,
    saturating to ±448, NaN kept), as int8. And the INT8 one
    (``training.kernel_bwd_sm90.RNE_S8X4_PTX``, ``fma.rn`` with 1.5·2^23 and the low bytes): the
    exact product ``x·r`` rounded half to even, as int8 (two's complement of the integer); NaN
    gives -1 and ±Inf 0 (the low bytes of 0x7FFFFFFF and 0x7F800000); a finite product of 2^22
    or more gives the low byte of ``x·r + 1.5·2^23`` rounded to fp32 through float64 (the
    kernel sends it only to rows whose products nothing reads). And ``CTAID_Y_PTX`` of the same
    module: the program's index along the grid's second axis."""
    from lowbit_attn.quant.fp4 import E2M1X2_CONSTRAINTS, E2M1X2_PTX
    from lowbit_attn.quant.fp4_naive import e2m1_code

    form = (asm, constraints, int(pack), dtype)
    if form == _e4m3x4_form():
        (x,) = args
        if x.dtype != torch.float32:
            raise ScheduleError("the E4M3 conversion takes fp32 values")
        from lowbit_attn.quant.int8_naive import to_e4m3

        return to_e4m3(x).view(torch.int8)
    if form == _ctaid_y_form():
        return torch.tensor(_machine().pid[1], dtype=torch.int32)
    if form == _rne_s8x4_form():
        x, r = (_t(a) for a in args)
        if x.dtype != torch.float32 or r.dtype != torch.float32:
            raise ScheduleError("the INT8 conversion takes fp32 values and reciprocals")
        y = torch.round(x.double() * r.double())
        finite = torch.isfinite(y)
        big = finite & (y.abs() >= 2 ** 22)
        wide = (x.double() * r.double() + 12582912.0).float().view(torch.int32).to(torch.int64)
        low = torch.where(finite & ~big, y, 0.0).to(torch.int64) & 0xFF
        low = torch.where(big, wide & 0xFF, low)
        low = torch.where(torch.isnan(y), 0xFF, low)
        return ((low ^ 0x80) - 0x80).to(torch.int8)
    if form != (E2M1X2_PTX.value, E2M1X2_CONSTRAINTS.value, 4, torch.uint8):
        raise NotModeled(f"inline_asm_elementwise of {asm!r}: only the E2M1X2 and E4M3X4 "
                         "conversions")
    lo, hi = args
    if lo.dtype != torch.float32 or hi.dtype != torch.float32:
        raise ScheduleError("the E2M1X2 conversion takes fp32 pairs")
    return (e2m1_code(lo) | (e2m1_code(hi) << 4)).to(torch.uint8)


def _e4m3x4_form() -> tuple:
    """``inference.gluon_blocks``' E4M3 conversion as :func:`_inline_asm_elementwise` compares
    it (imported when first needed: that module needs Gluon's Hopper API, which the Blackwell
    kernels' model does not)."""
    from lowbit_attn.inference.gluon_blocks import E4M3X4_CONSTRAINTS, E4M3X4_PTX

    return E4M3X4_PTX.value, E4M3X4_CONSTRAINTS.value, 4, torch.int8


def _ctaid_y_form() -> tuple:
    """``training.kernel_bwd_sm90``'s read of the grid's second index (``CTAID_Y_PTX``): the
    program id along axis 1."""
    from lowbit_attn.training.kernel_bwd_sm90 import CTAID_Y_PTX

    return CTAID_Y_PTX.value, "=r", 1, torch.int32


def _rne_s8x4_form() -> tuple:
    """``training.kernel_bwd_sm90``'s INT8 conversion, as :func:`_e4m3x4_form`."""
    from lowbit_attn.training.kernel_bwd_sm90 import RNE_S8X4_CONSTRAINTS, RNE_S8X4_PTX

    return RNE_S8X4_PTX.value, RNE_S8X4_CONSTRAINTS.value, 4, torch.int8


def _split(x):
    if x.shape[-1] != 2:
        raise ScheduleError(f"split of a last dimension of {x.shape[-1]}")
    return x[..., 0], x[..., 1]


def _tmem_reg_layout(*args, **kwargs):
    return _Layout(*args, **kwargs)


@contextlib.contextmanager
def _tensor_dialect():
    """For the launch, torch tensors answer the two tensor methods the kernels call that torch
    lacks: ``x.to(dtype, bitcast=True)`` (a bit view) and ``x.type.layout`` (a layout: None);
    ``x.to(...)`` and ``x.type(...)`` otherwise unchanged."""
    to, type_ = torch.Tensor.to, torch.Tensor.type

    def to_(self, *args, bitcast=False, **kwargs):
        if not bitcast:
            return to(self, *args, **kwargs)
        (dtype,) = args
        if dtype.itemsize != self.dtype.itemsize:
            raise ScheduleError(f"bitcast of {self.dtype} to {dtype}")
        return self.view(dtype)

    class _TensorType:
        layout = None

        def __init__(self, t):
            self.t = t

        def __call__(self, *args, **kwargs):
            return type_(self.t, *args, **kwargs)

    class _TypeAttribute:
        def __get__(self, obj, cls=None):
            return type_ if obj is None else _TensorType(obj)

    torch.Tensor.to, torch.Tensor.type = to_, _TypeAttribute()
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.type = to, type_


def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs=()):
    """Runs the partitions as threads taking turns (see :class:`_Machine`); returns what the
    default partition (the first) returns. ``worker_num_regs`` is not modelled."""
    functions_and_args = list(functions_and_args)
    if len(functions_and_args) != len(worker_num_warps) + 1:
        raise ScheduleError(f"warp_specialize of {len(functions_and_args)} partitions with "
                            f"{len(worker_num_warps)} worker warp counts")
    return _machine().specialize(functions_and_args, [int(w) for w in worker_num_warps])


def _not_modeled(name):
    def fail(*args, **kwargs):
        raise NotModeled(f"{name} is not modelled by lowbit_attn.tools.gluon_cpu")
    return fail


MBARRIER = _Namespace("mbarrier", init=_mb_init, expect=_mb_expect, arrive=_mb_arrive,
                      wait=_mb_wait, invalidate=_mb_invalidate, MBarrierLayout=_BarrierLayout)
TMA = _Namespace("tma", make_tensor_descriptor=_make_tensor_descriptor,
                 async_copy_global_to_shared=_async_copy_global_to_shared,
                 async_load=_async_copy_global_to_shared)  # its name from Triton 3.9 on
HOPPER_FUNCTIONS = {
    hopper.warpgroup_mma: _warpgroup_mma,
    hopper.warpgroup_mma_wait: _warpgroup_mma_wait,
    hopper.fence_async_shared: _fence_async_shared,
}
BLACKWELL_FUNCTIONS = {
    blackwell.fence_async_shared: _fence_async_shared,
    blackwell.allocate_tensor_memory: _allocate_tensor_memory,
    blackwell.tcgen05_mma_scaled: _tcgen05_mma_scaled,
    blackwell.tcgen05_copy: _tcgen05_copy,
    blackwell.tcgen05_commit: _tcgen05_commit,
}
FUNCTIONS = {**HOPPER_FUNCTIONS, **BLACKWELL_FUNCTIONS}
# constexpr functions of Gluon that only compute layouts: their value is a layout (ignored)
# (Triton 3.8 dropped get_tmem_reg_layout: there the model runs the Hopper kernels only)
LAYOUT_FUNCTIONS = {f: _tmem_reg_layout for f in [getattr(blackwell, "get_tmem_reg_layout", None)]
                    if f is not None}


# --- running a kernel ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Numerics:
    fused_fma: bool = False  # True: fma in float64, rounded once (double rounding aside)


def _layout_function(v):
    """The model of ``v`` if it is one of :data:`LAYOUT_FUNCTIONS` (by identity: hashing a Gluon
    JIT object hashes its dependencies), else None."""
    return next((f for k, f in LAYOUT_FUNCTIONS.items() if k is v), None)


def _is_jit(v) -> bool:
    return type(v).__module__.startswith("triton") and callable(getattr(v, "fn", None)) and \
        isinstance(v.fn, types.FunctionType)


class _Rebinder:
    """The kernel's functions with their globals pointing at this model."""

    def __init__(self, numerics, overrides, trace):
        self.trace = trace
        self.overrides = dict(overrides or {})
        self.langs = {"gl": _make_lang("gl", numerics), "tl": _make_lang("tl", numerics)}
        self.globals: dict[int, dict] = {}
        self.functions: dict = {}

    def translate(self, v):
        if v is gl:
            return self.langs["gl"]
        if v is tl:
            return self.langs["tl"]
        if v is real_mbarrier:
            return MBARRIER
        if v is real_tma or v is real_bw_tma:
            return TMA
        if isinstance(v, tl.constexpr):
            return v.value
        if _layout_function(v) is not None:
            return _layout_function(v)
        if _is_jit(v):
            return self.function(v)
        if isinstance(v, types.FunctionType) and v.__module__.startswith("triton"):
            return FUNCTIONS.get(v) or _not_modeled(v.__qualname__)
        return v

    def globals_for(self, g: dict) -> dict:
        if id(g) not in self.globals:
            new: dict = {}
            self.globals[id(g)] = new
            new.update({k: self.translate(v) for k, v in g.items()})
        return self.globals[id(g)]

    def function(self, jit):
        py = getattr(jit, "fn", jit)
        if py in self.functions:
            return self.functions[py]
        src = self.overrides.get(py, py)
        placeholder = {}
        self.functions[py] = lambda *a, **k: placeholder["f"](*a, **k)
        f = types.FunctionType(src.__code__, self.globals_for(src.__globals__), src.__name__,
                               src.__defaults__, src.__closure__)
        sig = inspect.signature(src)
        flags = [n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)]
        trace = self.trace

        def recorded(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            key = tuple((n, bound[n]) for n in flags
                        if isinstance(bound.get(n), (bool, int, str)))
            trace.calls[(py.__name__, key)] += 1
            return f(*args, **kwargs)

        recorded.__name__ = py.__name__
        placeholder["f"] = recorded
        self.functions[py] = recorded
        return recorded


def _arguments(v, name, constexpr=False):
    if isinstance(v, torch.Tensor):
        return Ptr.of(v, name)
    if type(v).__name__ == "TensorDescriptor":  # a host TMA descriptor (Gluon's)
        return _make_tensor_descriptor(Ptr.of(v.base, name), v.shape, v.strides, v.block_shape,
                                       v.layout)
    if isinstance(v, tuple):
        return tuple(_arguments(x, f"{name}[{i}]", constexpr) for i, x in enumerate(v))
    return v if constexpr else _kernel_scalar(v)


LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class CpuKernel:
    """Stands in for a ``@gluon.jit`` kernel object: ``CpuKernel(k)[grid](**kwargs)`` runs every
    program of the grid, in order, on CPU tensors. ``overrides``: ``{jit.fn: plain Python
    function}`` to run instead of a ``@jit`` function (a mutated copy, in tests; keyed by the
    plain function: hashing a Gluon JIT object hashes its dependencies). ``schedule``: the order
    in which the partitions of a ``warp_specialize`` take turns, one of :data:`SCHEDULES` ("lazy":
    the running partition goes on until it blocks, then the next in order runs; "eager": the next
    partition that can run takes over at every synchronisation point, round robin; "reverse": as
    "lazy", starting with the last worker and going round the other way). ``trace`` sums what the
    launches did."""

    def __init__(self, kernel, *, numerics: Numerics = Numerics(), overrides=None,
                 schedule: str = "lazy"):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.kernel = kernel
        self.schedule = schedule
        self.trace = Trace()
        self.rebinder = _Rebinder(numerics, overrides, self.trace)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if args:
                raise TypeError("launch the kernel with keyword arguments")
            params = inspect.signature(getattr(self.kernel, "fn", self.kernel)).parameters
            constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
            kw = {k: _arguments(v, k, k in constexprs) for k, v in kwargs.items()
                  if k not in LAUNCH_OPTIONS}
            fn = self.rebinder.function(self.kernel)
            state = _Launch(self.trace, self.schedule, int(kwargs.get("num_warps", 4)))
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            with _tensor_dialect(), _Integers():
                for pid in itertools.product(*(range(n) for n in grid3)):
                    m = _Machine((pid[0], pid[1], pid[2]), state)
                    _CURRENT.append(m)
                    try:
                        fn(**kw)
                        m.finish()
                    finally:
                        _CURRENT.pop()
                    self.trace.events["programs"] += 1
        return launch


def referenced_names(kernel) -> dict[str, set[str]]:
    """What the source of ``kernel`` and of every ``@jit`` function it reaches takes from Gluon and
    Triton: ``{"gl" | "tl" | "mbarrier" | "tma": attribute names used on that namespace,
    "functions": language functions imported by name}``."""
    real = {"gl": [gl], "tl": [tl], "mbarrier": [real_mbarrier], "tma": [real_tma, real_bw_tma]}
    names: dict[str, set[str]] = {ns: set() for ns in (*real, "functions")}
    seen = set()

    def visit(jit):
        py = jit.fn
        if py in seen:
            return
        seen.add(py)
        g = py.__globals__
        tree = ast.parse(textwrap.dedent(inspect.getsource(py)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                for ns, mods in real.items():
                    if any(g.get(node.value.id) is mod for mod in mods):
                        names[ns].add(node.attr)
            elif isinstance(node, ast.Name):
                v = g.get(node.id)
                if _layout_function(v) is not None:
                    names["functions"].add(v.fn.__qualname__)
                elif _is_jit(v):
                    visit(v)
                elif isinstance(v, types.FunctionType) and v.__module__.startswith("triton"):
                    names["functions"].add(v.__qualname__)

    visit(kernel)
    return names


def modeled_names() -> dict[str, set[str]]:
    """What this model implements, in the form of :func:`referenced_names`."""
    n = Numerics()
    return {"gl": _make_lang("gl", n).modeled(), "tl": _make_lang("tl", n).modeled(),
            "mbarrier": MBARRIER.modeled(), "tma": TMA.modeled(),
            "functions": {f.__qualname__ for f in FUNCTIONS} |
            {f.fn.__qualname__ for f in LAYOUT_FUNCTIONS}}


@contextlib.contextmanager
def kernel_on_cpu(module, name: str, **options):
    """Replace ``module.<name>`` (a ``@gluon.jit`` kernel) by a :class:`CpuKernel` for the
    duration; yields it (its ``trace`` fills as the launcher runs). ``options``: the
    :class:`CpuKernel`'s (``numerics``, ``overrides``, ``schedule``)."""
    real = getattr(module, name)
    cpu = CpuKernel(real, **options)
    setattr(module, name, cpu)
    try:
        yield cpu
    finally:
        setattr(module, name, real)


__all__ = ["SCHEDULES", "CpuKernel", "Hang", "NotModeled", "Numerics", "Overflow", "Race",
           "ScheduleError", "Trace", "canonical_reductions", "kernel_on_cpu", "modeled_names", "referenced_names"]
