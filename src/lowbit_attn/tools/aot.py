"""Ahead-of-time compilation of a recipe's kernels for a GPU target, on any machine (no GPU needed).

This is how tensor-core use is proven on a CPU machine: the kernels a call would launch are
compiled for ``sm_80`` … ``sm_120a`` with ``triton.compile``, the PTX is searched for tensor-core
instructions (``mma.sync``, ``wgmma.mma_async``, ``tcgen05.mma``) and Triton's bundled
``ptxas -v`` reports registers and spills::

    from lowbit_attn.tools.aot import compile_recipe
    for r in compile_recipe("qk_int8_pv_fp8", "sm_90a"):
        print(r.kernel, r.instructions, r.registers, r.spill_stores)

Which kernels, with which arguments: the real launch path (``inference.op.run``, Triton backend) runs
on small CPU tensors while every kernel object of the kernel packages is replaced by a
recorder, so AOT sees exactly the launches, pointer dtypes, ``None`` inputs and strides a GPU call
makes, and specializes them as Triton's launcher does (``None`` and integers equal to 1 become
constexprs, pointers and multiples of 16 get ``tt.divisibility = 16``). Launch options: an
autotuned kernel gets the first entry of its module's ``CONFIGS`` for the target's family that
its prune filter keeps for the launch (or the entry asked for); other kernels what their launcher
passes, or Triton's defaults.

Works under ``TRITON_INTERPRET=1`` too (the test suite sets it): ``triton.jit`` then returns
interpreter objects, so each kernel is rebuilt as a real ``JITFunction`` from its Python function,
and the interpreter's leftover patches of ``triton.language`` are undone for the duration of each
compilation (:mod:`lowbit_attn.tools.triton_compat`, written for one Triton version). The PTX is byte-identical to a clean process's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction, KernelInterface

from lowbit_attn.core import checks
from lowbit_attn.core.arch import (
    arch_name, fp4_pipeline_qk, native_fp4, parse_arch, tensor_memory,
)
from lowbit_attn.core.recipes import Recipe, resolve
from lowbit_attn.core.triton_support import GluonUnavailable
from lowbit_attn.tools.triton_compat import (
    as_jit_function, compiler_mode, pointer_type, ptxas_tool,
)

# The targets this package is built for; ``sm_90`` and friends are accepted and mean ``sm_90a``.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a")

# Constexprs the launchers set differently under the interpreter (or on the machine at hand) than
# on the target GPU, as functions of the target's capability: the interpreter's own E4M3
# conversion is inexact, so it builds the bits arithmetically (a GPU uses ``cvt``); FP4 emulation
# multiplies in fp32 under the interpreter (its bf16 dot is wrong) and in bf16 on a GPU; FP4
# tensor cores exist from sm_100 on; tensor-memory MMAs (sm_100 family) need the backward's
# per-tile scales reduced as [1, 1] tiles; the native FP4 attention runs Q·Kᵀ one key block
# ahead on sm_120.
GPU_CONSTEXPRS = {
    "EXACT_FP8": lambda capability: False,
    "EMU_FP32": lambda capability: False,
    "NATIVE_FP4": native_fp4,
    "PIPELINE_QK": fp4_pipeline_qk,
    "TMEM": tensor_memory,
}

# Tensor-core opcodes with their shape/type suffixes, operands stripped; optional predicate first.
_TC_OPCODE = re.compile(
    r"^\s*(?:@!?%\w+\s+)?((?:wgmma\.mma_async|tcgen05\.mma|mma)\.[\w.:]+)", re.MULTILINE
)
_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_RECORD_LOCK = threading.Lock()
_COMPILED: dict[tuple, "KernelReport"] = {}
_WGMMA_SHAPE = re.compile(r"\.m64n(\d+)k\d+\.")


@dataclass(frozen=True)
class KernelReport:
    """One kernel compiled for one target.

    Attributes:
        kernel: the ``@triton.jit`` function's name.
        arch: the target, e.g. ``"sm_90a"``.
        constexprs: its ``tl.constexpr`` parameters' values (what picks this specialization).
        num_warps, num_stages: launch options compiled with.
        instructions: distinct tensor-core instruction forms in the PTX (opcode with shape and type
            suffixes, operands stripped) → number of occurrences. On ``sm_100a`` ``tcgen05.mma``
            carries only its kind (``kind::f16``, ``kind::f8f6f4``…); shape and types live in the
            instruction descriptor.
        registers, spill_stores, spill_loads, stack_frame: from ``ptxas -v`` (bytes for the last
            three); ``None`` when compilation failed.
        ptxas_warnings: ptxas's warning lines (e.g. C7514: wgmma serialized), in order.
        shared_memory: bytes of shared memory Triton allocated.
        error: why compilation or ``ptxas`` failed (``None`` when it worked).
        ptx: the PTX text (left out of ``repr``).
        cubin: the assembled binary (left out of ``repr``; :mod:`lowbit_attn.tools.sass` reads it).
    """

    kernel: str
    arch: str
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    instructions: dict[str, int] = field(default_factory=dict)
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    ptxas_warnings: tuple[str, ...] = ()
    shared_memory: int | None = None
    error: str | None = None
    ptx: str = field(default="", repr=False)
    cubin: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def spills(self) -> int | None:
        """Spilled bytes, stores plus loads (0 is what a fast kernel needs)."""
        if self.spill_stores is None or self.spill_loads is None:
            return None
        return self.spill_stores + self.spill_loads

    def narrow_products(self, min_n: int = 64) -> list[str]:
        """The tensor-core forms that are not a wgmma at least ``min_n`` wide (``mma.sync``, or
        ``wgmma…m64nNk…`` with ``N < min_n``): what a Hopper kernel should not run in its main
        loops (issues 28 and 30 gate the training and VSA kernels on none, with no spills)."""
        narrow = []
        for form in self.instructions:
            shape = _WGMMA_SHAPE.search(form)
            if not form.startswith("wgmma") or (shape and int(shape.group(1)) < min_n):
                narrow.append(form)
        return narrow

    @property
    def variant(self) -> str:
        """The constexprs as ``NAME=value`` pairs, for display."""
        return ", ".join(f"{k}={v}" for k, v in self.constexprs.items())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (without the PTX and the binary)."""
        d = dataclasses.asdict(self)
        d.pop("ptx")
        d.pop("cubin")
        d["spills"] = self.spills
        return d


# ---------------------------------------------------------------------------------------------
# targets


def normalize_arch(arch: str) -> str:
    """``"sm_90"``/``"sm_90a"`` → ``"sm_90a"``; raises ``ValueError`` naming ``arch`` for anything
    that is not one of :data:`ARCHS`."""
    if not isinstance(arch, str):
        raise ValueError(f"arch must be a string like 'sm_90a', got {arch!r}")
    try:
        name = arch_name(parse_arch(arch))
    except ValueError:
        name = None
    if name not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    return name


def config_family(arch: str) -> str:
    """The key of a kernel module's ``CONFIGS`` that serves ``arch``: ``"sm_90"`` from Hopper on
    (``sm_90a``, ``sm_100a``, ``sm_120a``), else ``"sm_89"`` or ``"sm_80"`` (as ``configs_for``)."""
    capability = parse_arch(arch)
    if capability >= (9, 0):
        return "sm_90"
    if capability >= (8, 9):
        return "sm_89"
    return "sm_80"


def _capability_int(arch: str) -> int:
    major, minor = parse_arch(arch)
    return major * 10 + minor


def ptxas_path(arch: str) -> str:
    """The ``ptxas`` Triton itself assembles ``arch`` with (``TRITON_PTXAS_PATH`` /
    ``TRITON_PTXAS_BLACKWELL_PATH`` override): the wheel's ``ptxas-blackwell`` from ``sm_100`` on,
    and on Triton 3.9 from ``sm_90`` on (the PTX 3.9 writes for Hopper is too new for its older
    ``ptxas``); :func:`lowbit_attn.tools.triton_compat.ptxas_tool` asks Triton."""
    return ptxas_tool(_capability_int(arch))


# ---------------------------------------------------------------------------------------------
# recording the launches of one call


@dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` seen during a recorded call (``kernel`` is the launched
    object: a ``JITFunction`` or interpreter function, possibly under heuristics/autotuning)."""

    kernel: Any
    args: tuple
    kwargs: dict
    grid: Any = None

    @property
    def name(self) -> str:
        """The launched kernel's name."""
        return _kernel_name(self.kernel)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor handed to the kernel, also those inside tuple arguments."""
        found, todo = [], [*self.args, *self.kwargs.values()]
        while todo:
            value = todo.pop()
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, tuple):
                todo.extend(value)
        return found


class _Recorder:
    """Stands in for a kernel object: ``recorder[grid](...)`` notes the launch, runs nothing."""

    def __init__(self, kernel: Any, sink: list[Launch]) -> None:
        self._kernel = kernel
        self._sink = sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._sink.append(Launch(self._kernel, args, kwargs, grid))

        return launch


KERNEL_PACKAGES = ("core", "quant", "inference", "training", "vsa")


def kernel_modules(packages: tuple[str, ...] = KERNEL_PACKAGES) -> list[types.ModuleType]:
    """Every module of ``packages`` (of those that hold kernels), imported now: one first imported
    during a recorded call would launch for real. A Gluon module written for another Triton is
    left out (it cannot be imported, so no call launches it)."""
    modules = []
    for name in packages:
        package = importlib.import_module(f"lowbit_attn.{name}")
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            try:
                modules.append(importlib.import_module(info.name))
            except GluonUnavailable:
                pass
    return modules


@contextlib.contextmanager
def _recording(packages: tuple[str, ...] = KERNEL_PACKAGES):
    """Replace every kernel object of the kernel packages' modules by a recorder for
    the duration (under a lock: recordings do not overlap; the originals are always restored)."""
    sink: list[Launch] = []
    saved = []
    with _RECORD_LOCK:
        try:
            for module in kernel_modules(packages):
                for name, obj in list(vars(module).items()):
                    if isinstance(obj, KernelInterface):
                        saved.append((module, name, obj))
                        setattr(module, name, _Recorder(obj, sink))
            yield sink
        finally:
            for module, name, obj in saved:
                setattr(module, name, obj)


def record_launches(
    recipe: Recipe,
    *,
    head_dim: int = 128,
    causal: bool = False,
    dtype: torch.dtype = torch.float16,
    seq_len: int = 1024,
    return_lse: bool = False,
    varlen: bool = False,
    variant=None,
) -> list[Launch]:
    """The kernel launches, in order, of one dense ``[1, 2, seq_len, head_dim]`` attention call with
    ``recipe`` on the Triton backend (nothing runs: see the module docstring); ``varlen``: the same
    tokens as two packed sequences (``[seq_len, 2, head_dim]``, ``cu_seqlens`` ``[0, seq_len // 3,
    seq_len]``), as ``attention_varlen`` launches them. ``variant``: a
    :class:`~lowbit_attn.core.variants.Variant` (window, chunk, softcap, sinks) or None."""
    from lowbit_attn.core.operands import Seqs
    from lowbit_attn.core.options import KernelOptions
    from lowbit_attn.core.variants import PLAIN
    from lowbit_attn.inference import op

    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowbit_attn.Recipe, got {type(recipe).__name__}")
    shape = (seq_len, 2, head_dim) if varlen else (1, 2, seq_len, head_dim)
    q, k, v = (torch.zeros(shape, dtype=dtype) for _ in range(3))
    out = torch.zeros_like(q)
    seqs = None
    if varlen:
        cu = torch.tensor([0, seq_len // 3, seq_len], dtype=torch.int32)
        seq = Seqs(batch=2, max_len=seq_len - seq_len // 3, cu_seqlens=cu)
        seqs = (seq, seq)
    variant = PLAIN if variant is None else variant
    sinks = torch.zeros(2) if variant.sinks else None
    with _recording() as sink:
        op.run(
            q, k, v, out=out, recipe=recipe, scale=head_dim ** -0.5,
            causal_offset=0 if causal else None, return_lse=return_lse, backend="triton",
            seqs=seqs, options=KernelOptions.from_env(),  # as the op reads them
            variant=variant, sinks=sinks,
        )
    return list(sink)


# ---------------------------------------------------------------------------------------------
# from a launch to a compiler input


def autotune_configs(jit: JITFunction, family: str, autotuner: Autotuner) -> list:
    """The launch configs an autotuned kernel would try on ``family``: the autotuner's own
    ``family_configs`` (``core.triton_helpers.autotuned``) or its module's ``CONFIGS``, at
    ``family`` (the autotuner itself was built for the machine that imported it), else the
    autotuner's own list."""
    configs = getattr(autotuner, "family_configs", None)
    if configs is None:
        configs = getattr(sys.modules.get(jit.__module__), "CONFIGS", None)
    if isinstance(configs, dict) and configs.get(family):
        return list(configs[family])
    return list(autotuner.configs)


def _innermost(obj):
    while isinstance(obj, (Autotuner, Heuristics)):
        obj = obj.fn
    return obj


def candidates(jit: JITFunction, family: str, autotuner: Autotuner, named_args: dict) -> list:
    """The launch configs the autotuner may pick on ``family`` for a launch with ``named_args``:
    :func:`autotune_configs`, through the autotuner's ``early_config_prune`` if it has one (as
    its own run prunes them: ``inference/kernel_int8.py`` keys its candidates by head dim)."""
    configs = autotune_configs(jit, family, autotuner)
    prune = getattr(autotuner, "early_config_prune", None)
    return list(prune(configs, named_args)) if prune else configs


def launch_candidates(launch: Launch, arch: str) -> list:
    """The configs the autotuner may pick for ``launch`` on ``arch``, in order (:func:`candidates`;
    ``[]`` for a kernel that is not autotuned): ``compile_launch``'s ``config`` indexes them."""
    obj, args, kwargs = launch.kernel, launch.args, dict(launch.kwargs)
    while isinstance(obj, Heuristics):
        obj = obj.fn
    if not isinstance(obj, Autotuner):
        return []
    named = {**dict(zip(obj.arg_names, args)), **kwargs}
    return candidates(as_jit_function(_innermost(obj)), config_family(normalize_arch(arch)), obj,
                      named)


def _chosen_config(jit: JITFunction, family: str, autotuner: Autotuner, config: int,
                   named_args: dict):
    configs = candidates(jit, family, autotuner, named_args)
    if config >= len(configs):
        raise ValueError(
            f"config must be < {len(configs)} for {jit.__name__} on {family}, got {config}"
        )
    return configs[config]


def _unwrap(
    launch: Launch, family: str, config: int = 0
) -> tuple[JITFunction, dict[str, Any], dict[str, int]]:
    """(jit function, every argument by name, compile options) of a launch, as the wrappers would
    pass them on: the ``config``-th of the autotuner's :func:`candidates` for ``family`` (its
    options and meta-parameters), then the heuristics."""
    jit = as_jit_function(_innermost(launch.kernel))
    obj, args, kwargs = launch.kernel, launch.args, dict(launch.kwargs)
    options: dict[str, int] = {}
    while isinstance(obj, (Autotuner, Heuristics)):
        if isinstance(obj, Heuristics):
            named = {**dict(zip(obj.arg_names, args)), **kwargs}
            for name, rule in obj.values.items():
                kwargs[name] = rule(named)
        else:
            named = {**dict(zip(obj.arg_names, args)), **kwargs}
            chosen = _chosen_config(jit, family, obj, config, named)
            kwargs.update(getattr(chosen, "kwargs", None) or {})
            options = {"num_warps": chosen.num_warps, "num_stages": chosen.num_stages}
        obj = obj.fn
    options.update({key: kwargs.pop(key) for key in _OPTION_KEYS if key in kwargs})
    bound = inspect.signature(jit.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return jit, dict(bound.arguments), options


def _arg_kind(param, value) -> tuple[str, bool]:
    """(signature type, 16-divisible) of one argument, as Triton's launcher specializes it."""
    if param.is_constexpr or value is None:
        return "constexpr", False
    if type(value).__name__ == "TensorDescriptor":  # a host TMA descriptor (Gluon's)
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        return native_specialize_impl(BaseBackend, value, False, True, True)[0], False
    align = not (param.do_not_specialize or param.do_not_specialize_on_alignment)
    if isinstance(value, torch.Tensor):
        return pointer_type(value.dtype), align and value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        if value == 1 and not param.do_not_specialize:
            return "constexpr", False
        kind = "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")
        return kind, align and value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"cannot specialize argument {param.name}={value!r} for AOT compilation")


def specialize(jit: JITFunction, values: dict[str, Any], arch: str):
    """``(signature, constexprs, attrs)`` for ``ASTSource``, as a launch with ``values`` on an
    ``arch`` GPU gets them. A tuple argument (a tensor's strides, or an operand's tensors and
    strides, nested) is specialized element by element, its constexprs and attributes keyed by
    their index path ``(argument, element, ...)`` (other constexprs by name, as ``ASTSource`` takes
    both)."""
    signature, constexprs, attrs = {}, {}, {}

    def visit(param, value, path):
        if isinstance(value, tuple) and not param.is_constexpr:
            return tuple(visit(param, item, path + (j,)) for j, item in enumerate(value))
        kind, divisible = _arg_kind(param, value)
        if kind == "constexpr":
            constexprs[path if len(path) > 1 else param.name] = value
        elif divisible:
            attrs[path] = [["tt.divisibility", 16]]
        return kind

    for i, param in enumerate(jit.params):
        value = values[param.name]
        if param.is_constexpr and param.name in GPU_CONSTEXPRS:
            value = GPU_CONSTEXPRS[param.name](parse_arch(arch))
        signature[param.name] = visit(param, value, (i,))
    return signature, constexprs, attrs


# ---------------------------------------------------------------------------------------------
# compiling and reading the result


def tensor_core_instructions(ptx: str) -> dict[str, int]:
    """Distinct tensor-core instruction forms in ``ptx`` → occurrences, e.g.
    ``{"wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8": 4}``."""
    counts: dict[str, int] = {}
    for match in _TC_OPCODE.finditer(ptx):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return dict(sorted(counts.items()))


def parse_ptxas_log(log: str, kernel: str | None = None) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame (bytes) of ``kernel``'s entry (the first entry
    when ``kernel`` is None) from ``ptxas -v`` output; raises ``ValueError`` if they are missing."""
    blocks = re.split(r"Compiling entry function '", log)[1:]
    if kernel is not None:
        blocks = [b for b in blocks if b.startswith(kernel + "'")] or blocks
    if not blocks:
        raise ValueError("ptxas -v output names no entry function")
    block = blocks[0]
    regs = re.search(r"Used (\d+) registers", block)
    frame = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block
    )
    if regs is None or frame is None:
        raise ValueError(f"ptxas -v output has no register/spill line:\n{block}")
    return {
        "registers": int(regs.group(1)),
        "stack_frame": int(frame.group(1)),
        "spill_stores": int(frame.group(2)),
        "spill_loads": int(frame.group(3)),
    }


def ptxas_warnings(log: str) -> tuple[str, ...]:
    """The warning lines of a ``ptxas`` log (``ptxas warning : ...``), stripped, in order."""
    return tuple(line.strip() for line in log.splitlines() if "ptxas warning" in line)


def run_ptxas(ptx: str, arch: str, kernel: str | None = None) -> dict:
    """Assemble ``ptx`` with ``ptxas -arch=<arch> -v`` and return :func:`parse_ptxas_log`'s fields
    plus ``ptxas_warnings`` (:func:`ptxas_warnings`); raises ``RuntimeError`` with ptxas's messages
    when it fails."""
    with tempfile.TemporaryDirectory(prefix="lowbit_attn_aot_") as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = os.path.join(tmp, "kernel.cubin")
        cmd = [ptxas_path(arch), f"-arch={arch}", "-v", src, "-o", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -arch={arch} failed ({proc.returncode}):\n{log.strip()}")
    return {**parse_ptxas_log(log, kernel), "ptxas_warnings": ptxas_warnings(log)}


def _declared_constexprs(jit: JITFunction, constexprs: dict[Any, Any]) -> dict[str, Any]:
    return {p.name: constexprs[p.name] for p in jit.params if p.is_constexpr}


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()}"


def _kernel_name(obj) -> str:
    obj = _innermost(obj)
    return getattr(obj, "__name__", type(obj).__name__)


def compile_launch(launch: Launch, arch: str, config: int = 0) -> KernelReport:
    """Compile one recorded launch for ``arch`` and report its tensor-core instructions, registers
    and spills. An autotuned kernel gets its ``config``-th launch config for the target's family
    (``ValueError`` if it has fewer). Failures (Triton or ptxas) are returned in ``error``, not
    raised. Cached per specialization for the life of the process."""
    arch = normalize_arch(arch)
    try:
        jit, values, options = _unwrap(launch, config_family(arch), config)
        signature, constexprs, attrs = specialize(jit, values, arch)
    except (RuntimeError, TypeError) as exc:
        return KernelReport(kernel=_kernel_name(launch.kernel), arch=arch, constexprs={},
                            num_warps=0, num_stages=0, error=_error_text(exc))
    options = {"num_warps": 4, "num_stages": 3, **options}  # Triton's defaults
    key = (arch, jit.__module__, jit.__qualname__, repr(sorted(signature.items())),
           repr(sorted(constexprs.items(), key=repr)), repr(sorted(attrs.items())),
           repr(sorted(options.items())))
    if key in _COMPILED:
        return _COMPILED[key]
    base = dict(kernel=jit.__name__, arch=arch, constexprs=_declared_constexprs(jit, constexprs),
                num_warps=options["num_warps"], num_stages=options["num_stages"])
    try:
        # A Gluon kernel (``triton.experimental.gluon.jit``) is lowered from its own source kind.
        source = GluonASTSource if jit.is_gluon() else ASTSource
        src = source(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
        with compiler_mode():
            compiled = triton.compile(src, target=GPUTarget("cuda", _capability_int(arch), 32),
                                      options=options)
        ptx = compiled.asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - every failure is reported, per kernel
        report = KernelReport(**base, error=_error_text(exc))
    else:
        usage: dict[str, int] = {}
        error = None
        try:
            usage = run_ptxas(ptx, arch, compiled.metadata.name)
        except (OSError, RuntimeError, ValueError) as exc:
            error = _error_text(exc)
        report = KernelReport(
            **base, instructions=tensor_core_instructions(ptx), error=error, ptx=ptx,
            cubin=compiled.asm.get("cubin", b""), shared_memory=compiled.metadata.shared, **usage,
        )
    _COMPILED[key] = report
    return report


def compile_recipe(
    recipe: str | Recipe,
    arch: str,
    head_dim: int = 128,
    causal: bool = False,
    dtype: torch.dtype = torch.float16,
    *,
    return_lse: bool = False,
    seq_len: int = 1024,
    config: int = 0,
    varlen: bool = False,
    variant=None,
) -> list[KernelReport]:
    """Compile, for ``arch``, every kernel one attention call with ``recipe`` launches (quantizers
    first, attention last; identical launches once) and report each (see :class:`KernelReport`).
    ``variant``: the LLM variants' :class:`~lowbit_attn.core.variants.Variant` (None: plain).

    Args:
        recipe: a recipe name, ``"auto"`` (resolved for ``arch``) or a :class:`~lowbit_attn.Recipe`.
        arch: one of :data:`ARCHS` (``"sm_90"`` means ``"sm_90a"``).
        head_dim: D, 1 to 256; ``BLOCK_D`` is its next power of two.
        causal: compile the causal variant.
        dtype: input/output dtype (float16, bfloat16 or float32).
        return_lse: include what ``return_lse=True`` adds (LSE output, LSE shift kernel).
        seq_len: tokens of the representative call; only strides (their divisibility by 16)
            depend on it.
        config: which entry of an autotuned kernel's configs for the target's family, of those
            its prune filter keeps for this launch, to compile (0, the first, by default).
        varlen: the call of ``attention_varlen`` on the same tokens as two packed sequences
            (see :func:`record_launches`).
    Returns:
        one report per distinct kernel specialization; ``[]`` for ``"exact"`` (no Triton kernel).
    """
    arch = normalize_arch(arch)
    if (isinstance(head_dim, bool) or not isinstance(head_dim, int)
            or not 1 <= head_dim <= checks.MAX_HEAD_DIM):
        raise ValueError(f"head_dim must be an int in [1, {checks.MAX_HEAD_DIM}], got {head_dim!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.float16, bfloat16 or float32, got {dtype!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(config, bool) or not isinstance(config, int) or config < 0:
        raise ValueError(f"config must be an int >= 0, got {config!r}")
    r = resolve(recipe, parse_arch(arch))
    checks.recipe_fits(r, head_dim)  # what the public functions refuse is not compiled either
    launches = record_launches(r, head_dim=head_dim, causal=causal, dtype=dtype, seq_len=seq_len,
                               return_lse=return_lse, varlen=varlen, variant=variant)
    return _compile_all(launches, arch, config)


def _compile_all(launches: list[Launch], arch: str, config: int) -> list[KernelReport]:
    reports: list[KernelReport] = []
    for launch in launches:
        report = compile_launch(launch, arch, config)  # identical launches: the same object
        if not any(report is seen for seen in reports):
            reports.append(report)
    return reports


def record_train_launches(
    recipe, *, head_dim: int = 128, causal: bool = False, dtype: torch.dtype = torch.bfloat16,
    seq_len: int = 1024, dq_mode: str = "recompute", bwd_kernel: str = "triton", variant=None,
) -> list[Launch]:
    """The kernel launches of one trainable attention forward and backward (``[1, 2, seq_len,
    head_dim]``, a :class:`~lowbit_attn.core.recipes.TrainRecipe` or its name) on the Triton backend;
    ``dq_mode``: ``"recompute"`` or ``"atomic"``, as ``LOWBIT_ATTN_TRAIN_DQ`` chooses, and
    ``bwd_kernel``: ``"triton"`` or ``"sm90"`` (where it applies), as ``LOWBIT_ATTN_BWD_KERNEL``
    does on an sm_90 device (:mod:`lowbit_attn.core.options`); ``variant``: a
    :class:`~lowbit_attn.core.variants.Variant` (window, chunk, softcap) or None."""
    from lowbit_attn.training.prepare import prepare, prepare_grad
    from lowbit_attn.core.recipes import resolve_train
    from lowbit_attn.core.variants import PLAIN
    from lowbit_attn.training import kernel_bwd, kernel_fwd

    r = resolve_train(recipe)
    q, k, v, do = (torch.zeros(1, 2, seq_len, head_dim, dtype=dtype) for _ in range(4))
    lse = torch.zeros(1, 2, seq_len)
    offset = 0 if causal else None
    scale = head_dim ** -0.5
    variant = PLAIN if variant is None else variant
    with _recording() as sink:
        ops = prepare(q, k, v, r, scale, "triton", softcap=variant.softcap > 0)
        kernel_fwd.forward(ops, out=torch.zeros_like(q), causal_offset=offset, variant=variant)
        grad = prepare_grad(do, r, "triton")
        kernel_bwd.backward(ops, grad, lse, torch.zeros_like(q), torch.zeros_like(k),
                            torch.zeros_like(v), causal_offset=offset, softmax_scale=scale,
                            mode=dq_mode, kernel=bwd_kernel, variant=variant)
    return list(sink)


def record_vsa_launches(*, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                        recipe: str = "exact", topk: int = 4,
                        bwd_kernel: str = "triton") -> list[Launch]:
    """The kernel launches of the video sparse attention fine stage on a 4×16×16 grid of 4×4×4
    tiles (16 tiles of 64 tokens): tokens to tiles (with tile means) and back, forward and
    backward (``recipe="exact"``; the backward on ``bwd_kernel``, as
    :func:`record_train_launches`), or the 8-bit inference forward with its quantization and
    tiling (``"qk_int8_pv_fp8"``, ``"qk_int8_pv_fp16"``)."""
    from lowbit_attn.vsa import op as vsa_ops
    from lowbit_attn.vsa import kernel_fine as vsa_fine, kernel_tiles as vsa_tiles
    from lowbit_attn.vsa.tiles import tile_layout
    from lowbit_attn.vsa.interface import resolve_recipe

    layout = tile_layout((4, 16, 16), (4, 4, 4))
    nt, ts = layout.n_tiles, layout.tile_tokens
    idx = torch.zeros(1, 2, nt, topk, dtype=torch.int32)
    counts = layout.counts.to(torch.int32)
    scale = head_dim ** -0.5
    with _recording() as sink:
        if recipe == "exact":
            x = torch.zeros(1, 2, layout.n_tokens, head_dim, dtype=dtype)
            qt, _ = vsa_tiles.tile(x, layout.index, layout.counts, slots=ts, pool=True)
            kt, vt, dot = (torch.zeros_like(qt) for _ in range(3))
            lse = torch.zeros(1, 2, nt, ts)
            vsa_fine.forward(qt, kt, vt, idx, counts, scale=scale)
            vsa_fine.backward(qt, kt, vt, torch.zeros_like(qt), lse, dot, idx, counts, scale=scale,
                              kernel=bwd_kernel)
            vsa_tiles.untile(qt, torch.zeros(1, 2, nt, head_dim), layout.index, layout.counts,
                             n_tokens=layout.n_tokens, dtype=dtype)
        else:
            q, k, v = (torch.zeros(1, 2, layout.n_tokens, head_dim, dtype=dtype) for _ in range(3))
            vsa_ops.kernel_int8(q, k, v, idx, layout, scale, resolve_recipe(recipe))
    return list(sink)


def record_decode_launches(recipe: str = "kv_int8_fp8", *, head_dim: int = 128, n: int = 1,
                           dtype: torch.dtype = torch.float16, page_size: int = 64,
                           tokens: int = 700) -> list[Launch]:
    """The launches of one read of the quantized KV cache (``kvcache/kernel_decode.py``: the split
    kernel, then the merge) by ``n`` queries of 32 heads, GQA 8, against ``tokens`` tokens of two
    sequences in ``page_size``-token pages of a ``dtype`` cache, as a GPU makes them: the launcher
    believes it is not interpreted (the open page's product, the split's warps). The cache's
    appends are recorded too and dropped (nothing runs)."""
    from lowbit_attn.kvcache import kernel_decode
    from lowbit_attn.kvcache.cache import QuantizedKVCache

    cache = QuantizedKVCache(1, 2, 4, head_dim, max_tokens=-(-tokens // page_size) * page_size,
                             page_size=page_size, recipe=recipe, dtype=dtype)
    kv = torch.zeros(2, 4, tokens, head_dim, dtype=dtype)
    packages = (*KERNEL_PACKAGES, "kvcache")
    with _recording(packages):
        cache.append(0, kv, kv)
    interpreted = kernel_decode.interpreter_enabled
    with _recording(packages) as sink:
        try:
            kernel_decode.interpreter_enabled = lambda: False
            kernel_decode.attention(torch.zeros(2, 32, n, head_dim, dtype=dtype), cache.layers[0],
                                    cache.recipe, scale=head_dim ** -0.5)
        finally:
            kernel_decode.interpreter_enabled = interpreted
    return list(sink)


def compile_decode(recipe: str = "kv_int8_fp8", arch: str = "sm_90a", head_dim: int = 128,
                   n: int = 1, dtype: torch.dtype = torch.float16) -> list[KernelReport]:
    """Compile, for ``arch``, the kernels of one read of the quantized KV cache
    (:func:`record_decode_launches`) and report each."""
    return _compile_all(record_decode_launches(recipe, head_dim=head_dim, n=n, dtype=dtype),
                        normalize_arch(arch), 0)


def record_sm90_launch(*, head_dim: int = 128, causal: bool = False, return_lse: bool = False,
                       seq_len: int = 1024, dtype: torch.dtype = torch.float16,
                       granularity: str = "per_thread", pv: str = "fp8",
                       seq_len_k: int | None = None, **launcher) -> Launch:
    """The launch of the one-warpgroup Hopper forward (``inference.kernel_int8_sm90``) on the
    operands of a dense ``[1, 2, seq_len, head_dim]`` ``qk_int8_pv_{pv}`` call with 128-key
    blocks and ``granularity`` scales (E4M3 V permuted), as the quantization launch allocates
    them (nothing runs on a device). ``launcher``: the launcher's candidate options
    (``k_stages``, ``maxnreg``); ``seq_len_k``: the keys (default ``seq_len``)."""
    from lowbit_attn.core.recipes import get_recipe
    from lowbit_attn.inference import kernel_int8_sm90
    from lowbit_attn.inference.prepare import quantize_qkv

    recipe = get_recipe(f"qk_int8_pv_{pv}").replace(block_k=kernel_int8_sm90.BLOCK_N,
                                                    granularity=granularity)
    nk = seq_len if seq_len_k is None else seq_len_k
    q = torch.zeros(1, 2, seq_len, head_dim, dtype=dtype)
    k, v = (torch.zeros(1, 2, nk, head_dim, dtype=dtype) for _ in range(2))
    with _recording():
        qz = quantize_qkv(q, k, v, recipe, head_dim ** -0.5, need_lse_shift=return_lse,
                          backend="triton", permute_v=pv == "fp8")
    with _recording() as sink:
        kernel_int8_sm90.attention(
            qz, out=torch.zeros_like(q), pv=recipe.pv, granularity=recipe.granularity,
            block_q=recipe.block_q, block_k=recipe.block_k, causal_offset=0 if causal else None,
            return_lse=return_lse, **launcher,
        )
    (launch,) = sink
    return launch


def record_fp4_gluon_launch(*, recipe: str = "qk_fp4_pv_fp4", head_dim: int = 128,
                            block_k: int = 64, causal: bool = False, return_lse: bool = False,
                            seq_len: int = 1024, dtype: torch.dtype = torch.float16,
                            smooth_q: bool | None = None,
                            smooth_k: bool | None = None) -> Launch:
    """The launch of the Gluon Blackwell FP4 forward (``inference.kernel_fp4_gluon``) on the
    operands a dense ``[1, 2, seq_len, head_dim]`` call with the FP4 ``recipe`` (``block_k``
    keys) hands the Triton kernel: that call is recorded, then the Gluon launcher runs on its
    operands (nothing runs on a device). ``smooth_q`` (ΔS) and ``smooth_k`` (with
    ``return_lse``: the LSE shift): the recipe's defaults unless given (``False, False``: the
    kernel's first version, without ΔS or the shift)."""
    from lowbit_attn.core.operands import QuantizedFP4
    from lowbit_attn.core.recipes import get_recipe
    from lowbit_attn.inference import kernel_fp4_gluon

    base = get_recipe(recipe)
    r = base.replace(block_k=block_k,
                     smooth_q=base.smooth_q if smooth_q is None else smooth_q,
                     smooth_k=base.smooth_k if smooth_k is None else smooth_k)
    kw = record_launches(r, head_dim=head_dim, seq_len=seq_len, return_lse=return_lse,
                         dtype=dtype)[-1].kwargs
    (q, qs, qg, *_), (k, ks, kg, *_), (v, vs, vg, *_) = kw["q"], kw["k"], kw["v"]
    qz = QuantizedFP4(fmt="nvfp4" if kw["NV"] else "mxfp4", q=q, q_scale=qs, k=k, k_scale=ks,
                      v=v, v_scale=vs, qk_multiplier=kw["qk_multiplier"], q_global=qg,
                      k_global=kg, v_global=vg, v_mean=kw["VM"], delta_s=kw["DS"],
                      lse_shift=kw["LSH"])
    with _recording() as sink:
        kernel_fp4_gluon.attention(qz, out=kw["O"], head_dim=head_dim, block_q=128,
                                   block_k=block_k, causal_offset=0 if causal else None,
                                   two_level=kw["TWO_LEVEL"], return_lse=return_lse)
    (launch,) = sink
    return launch


def compile_vsa(arch: str = "sm_90a", head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                config: int = 0, recipe: str = "exact",
                bwd_kernel: str = "triton") -> list[KernelReport]:
    """Compile, for ``arch``, the fine stage's kernels (see :func:`record_vsa_launches`) and
    report each."""
    return _compile_all(record_vsa_launches(head_dim=head_dim, dtype=dtype, recipe=recipe,
                                            bwd_kernel=bwd_kernel),
                        normalize_arch(arch), config)


def compile_train(recipe="sagebwd_int8", arch: str = "sm_90a", head_dim: int = 128,
                  causal: bool = False, dtype: torch.dtype = torch.bfloat16,
                  config: int = 0, dq_mode: str = "recompute",
                  bwd_kernel: str = "triton", variant=None) -> list[KernelReport]:
    """Compile, for ``arch``, every kernel of one trainable attention forward and backward and
    report each (see :func:`compile_recipe`; ``bwd_kernel`` and ``variant`` as
    :func:`record_train_launches`)."""
    arch = normalize_arch(arch)
    launches = record_train_launches(recipe, head_dim=head_dim, causal=causal, dtype=dtype,
                                     dq_mode=dq_mode, bwd_kernel=bwd_kernel, variant=variant)
    return _compile_all(launches, arch, config)


@functools.lru_cache(maxsize=None)
def ptxas_version(arch: str) -> str:
    """``ptxas --version``'s release (e.g. ``"12.8"``) for ``arch``'s ptxas, or ``"unknown"``."""
    try:
        out = subprocess.run([ptxas_path(arch), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


__all__ = [
    "ARCHS", "GPU_CONSTEXPRS", "KernelReport", "Launch", "compile_recipe", "compile_launch",
    "kernel_modules",
    "compile_train", "record_train_launches", "record_fp4_gluon_launch", "compile_vsa", "record_vsa_launches",
    "record_launches", "normalize_arch", "config_family", "autotune_configs", "candidates",
    "launch_candidates", "record_decode_launches", "compile_decode",
    "tensor_core_instructions",
    "parse_ptxas_log", "ptxas_warnings", "run_ptxas", "ptxas_path", "ptxas_version", "as_jit_function", "specialize",
]
