"""Experimental kernel placements, until a GPU measurement decides them: one frozen object, read
from the environment once per call (by every attention call, so that a bad value raises
anywhere: :func:`check_env`) and passed down explicitly.

- ``LOWBIT_ATTN_TRAIN_DQ``: ``recompute`` (default: a dQ kernel that recomputes S and dP per query
  block; deterministic) or ``atomic`` (the dK/dV kernel adds each tile's dS·K into an fp32
  buffer: two fewer matmuls per tile, summation order not fixed).
- ``LOWBIT_ATTN_BWD_KERNEL``: ``measured`` (default: the kernel a GPU run measured fastest on
  the device's architecture, ``core/measured.py`` ``KERNEL_CHOICES``: ``sm90`` on Hopper, the
  Triton backward elsewhere), ``triton`` (the Triton backward kernels) or ``sm90`` (the
  Gluon backward loops for Hopper, ``training/kernel_bwd_sm90.py``: 128 keys per program on two
  warpgroups, the score tile transposed, INT8 P and dS from registers; where it applies: a CUDA
  device of capability 9.0, the trainable attention (P and dS per tile or per row),
  INT8 Q·Kᵀ, dV, dK and dQ, 16-bit dP, no Q smoothing, D = 64 or 128, dQ by ``recompute``; and
  video sparse attention's 16-bit fine stage, 64-token tiles, D = 64 or 128, the same loops
  over its tile lists; the Triton kernels elsewhere). Admitted on a device only after a
  one-time check of dQ, dK and dV against the Triton backward there
  (``training/sm90_check.py``; the Triton backward runs until it passes). Measured on an H200
  (2026-11-29): faster than the Triton backward on every row; on a CPU it changes nothing.
- ``LOWBIT_ATTN_KERNEL``: ``measured`` (default: the forward a GPU run measured fastest on the
  device's architecture and that passed its GPU tests there, ``core/measured.py``
  ``KERNEL_CHOICES``; none yet, so the Triton kernels everywhere), ``triton`` (the Triton
  attention kernels), ``sm90`` (the one-warpgroup Hopper forward,
  ``inference/kernel_int8_sm90.py``, where it applies: capability 9.0, dense INT8 recipes with
  per-token or per-thread scales, 128-key blocks, no Q smoothing, D = 64 or 128; FP4 recipes keep
  the Triton kernel under it) or ``gluon`` (the Gluon forward of the device's architecture: on
  Hopper the ``sm90`` forward; on Blackwell the Gluon FP4 forward,
  ``inference/kernel_fp4_gluon.py``, where it applies: a CUDA device of capability 10.x
  (sm_100a), the FP4 recipes (NVFP4, MXFP4), D = 128, the default 128-row query and 64-key
  blocks; the Triton kernels elsewhere).
  Admitted on a device only after a one-time check against the Triton kernel there
  (``inference/sm90_check.py``, ``inference/gluon_fp4_check.py``, the machinery
  ``inference/gluon_check.py``). Neither is the default: ``sm90`` has run on an H200 (2026-11-30:
  kernel alone 1.08–1.29× SDPA cuDNN at N ≥ 8k) but not yet passed its check on one; the FP4
  one runs on the CPU model ``tools/gluon_cpu.py`` only. On a CPU (the interpreter) each is
  accepted and changes nothing: Triton has no Gluon interpreter. (The Gluon ping-pong Hopper
  forward ``gluon`` ran before 2026-12-01 is deleted: end to end it was slower than the Triton
  kernels on every row of the H200 run of 2026-11-27.)

- ``LOWBIT_ATTN_LAUNCH``: ``plan`` (default: an eager call replays its configuration's recorded
  launches from the third call on: ``core/plans.py``; its GPU tests passed on an H200,
  2026-11-30) or ``triton`` (every launch through Triton's own launch path).
- ``LOWBIT_ATTN_COMPILE``: ``parallel`` (default: the first eager ``attention()`` call of a
  configuration first runs as a dry pass that compiles all its kernels side by side in threads
  and launches nothing, ``core/plan_launches.py`` ``compile_ahead``; then it runs; on an H200,
  2026-11-30, a new shape's first call on a cold cache took 3.36 s at D = 128 against 5.31 s
  compiled one after another, 3.65 against 4.93 at D = 64) or ``serial`` (each kernel compiles
  at its first launch, one after another).

Why the defaults are what they are: ``benchmarks/NOTES.md``. Each option is used on the Triton
backend only; the PyTorch twins take the object and compute the same values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowbit_attn.core import measured
from lowbit_attn.core.arch import ENV

DQ_MODES = ("recompute", "atomic")
BWD_KERNELS = ("measured", "triton", "sm90")
KERNELS = ("measured", "triton", "gluon", "sm90")
LAUNCH_MODES = ("plan", "triton")
COMPILE_MODES = ("parallel", "serial")
# Each option's field → (its environment variable, its modes, the default first)
VARIABLES = {"train_dq": ("LOWBIT_ATTN_TRAIN_DQ", DQ_MODES),
             "bwd_kernel": ("LOWBIT_ATTN_BWD_KERNEL", BWD_KERNELS),
             "kernel": ("LOWBIT_ATTN_KERNEL", KERNELS),
             "launch": ("LOWBIT_ATTN_LAUNCH", LAUNCH_MODES),
             "compile": ("LOWBIT_ATTN_COMPILE", COMPILE_MODES)}


def env_names(names) -> tuple:
    """``names`` as :data:`ENV` keys them."""
    return tuple(map(os.environ.encodekey, names))


_NAMES = env_names(variable for variable, _ in VARIABLES.values())
_parsed: dict[tuple, "KernelOptions"] = {}  # the options of each set of raw values met


@dataclass(frozen=True)
class KernelOptions:
    """Where the Triton path does some of its work (see the module docstring); the defaults are
    the production path."""

    train_dq: str = DQ_MODES[0]
    bwd_kernel: str = BWD_KERNELS[0]
    kernel: str = KERNELS[0]
    launch: str = LAUNCH_MODES[0]
    compile: str = COMPILE_MODES[0]

    def __post_init__(self) -> None:
        for field, (variable, choices) in VARIABLES.items():
            value = getattr(self, field)
            if value not in choices:
                raise ValueError(f"{variable} must be one of {choices}, got {value!r}")

    @classmethod
    def from_env(cls) -> "KernelOptions":
        """The options the environment sets (``ValueError`` naming the variable for a value that
        is not one of its modes)."""
        raw = tuple(map(ENV.get, _NAMES))
        found = _parsed.get(raw)
        if found is None:  # a bad value raises here every time: it is never kept
            found = _parsed[raw] = cls(**{
                field: choices[0] if value is None else os.environ.decodevalue(value)
                for (field, (_, choices)), value in zip(VARIABLES.items(), raw)})
        return found

    @property
    def launch_plans(self) -> bool:
        """Whether eager calls record and replay launch plans (``plan``)."""
        return self.launch == "plan"

    @property
    def compile_ahead(self) -> bool:
        """Whether a configuration's first eager call compiles its kernels side by side first
        (``parallel``)."""
        return self.compile == "parallel"

    def forward_kernel(self, device: torch.device) -> str:
        """``kernel`` for a call on ``device``, ``measured`` resolved: the kernel
        ``core.measured.KERNEL_CHOICES`` names for the device's architecture, else ``triton``.
        ``sm90``: INT8 calls to the one-warpgroup Hopper forward where it applies; ``gluon``:
        the Gluon forward of the device's architecture where it applies (INT8 calls to the
        ``sm90`` forward, FP4 calls to the Blackwell one)."""
        if self.kernel != "measured":
            return self.kernel
        if device.type != "cuda" or not any(c.option == "kernel" for c in measured.KERNEL_CHOICES):
            return "triton"  # no measurement to read: no device query on the call's path
        from lowbit_attn.core.triton_helpers import family

        return (measured.kernel_choice("kernel", family(torch.cuda.get_device_capability(device)))
                or "triton")


def check_env() -> None:
    """Raise the ``ValueError`` of a placement variable set to no mode of its own, for the calls
    whose kernels read the options only later (in a custom op, the backward) or not at all, so
    that a bad value raises on every call. Not under ``torch.compile``: the ops read them there,
    and tracing the read would guard the graph on the whole environment."""
    if not torch.compiler.is_compiling():
        KernelOptions.from_env()
