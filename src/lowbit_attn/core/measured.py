"""What GPU runs measured best, per architecture: launch configurations used without autotuning
(issue 43: a new shape's first call compiles and times the one candidate measured best on its
architecture, not every candidate), the kernel a placement variable's default runs
(:data:`KERNEL_CHOICES`), and the keys per split of the KV-cache decode kernel
(:data:`DECODE_SPLITS`).

Each :class:`Measured` names an autotuned kernel (its ``@triton.jit`` function), the architecture
family of its ``CONFIGS`` (``core.triton_helpers.family``), the launch arguments a call must have
for it to apply (the constexprs of its autotuning key, as the kernel's prune filter sees them),
the candidate (warps, stages, meta-parameters) and the run that measured it. A launch that no
entry matches, even but for :data:`SAME_TILES`, is autotuned as before.
``LOWBIT_ATTN_AUTOTUNE=all`` autotunes every launch (what the benchmarks' ``tuned`` rows do to
measure the next entries); ``first`` gives each kernel its first candidate alone (test runs).

Data, not code: an entry is added or changed only from a GPU run's table, with the run named in
``source``; ``benchmarks/NOTES.md`` ("Measured defaults") says which rows each came from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """One measured choice: on ``family``, launches of ``kernel`` whose arguments equal ``match``
    run the candidate ``(num_warps, num_stages, meta)`` alone; ``source``: the GPU run."""

    kernel: str
    family: str
    match: tuple  # (argument name, value) pairs
    num_warps: int
    num_stages: int
    meta: tuple  # (meta-parameter name, value) pairs, as LaunchConfig.meta
    source: str

    def applies(self, kernel: str, family: str, args: dict, ignoring: tuple = ()) -> bool:
        """Whether a launch of ``kernel`` on ``family`` with ``args`` has every value of
        ``match`` (those named in ``ignoring`` aside)."""
        return (kernel == self.kernel and family == self.family
                and all(args.get(name) == value for name, value in self.match
                        if name not in ignoring))


# The INT8 forward as users call it on Hopper (qk_int8_pv_fp8: per-token scales, 64-key blocks,
# FP8 P·V, dense, no window or softcap), D = 128: the H100's autotuner's choice at N = 1k and
# 16k, causal and not (4 of 4), and at 16k the fastest of the candidates forced one at a time
# (523 TOP/s non-causal, against 465, 435, 433 and 371); the H200's choice at N = 1k, 8k, 16k
# and causal 16k (4 of 4). D = 64: the H200's choice, the same candidate, 4 of 4.
MEASURED = (
    Measured("_attn_fwd_int8_kernel", "sm_90",
             (("D", 128), ("BLOCK_N", 64), ("BLOCK_Q", 128), ("GRAN", 1), ("PV_FP8", True),
              ("VARLEN", False), ("V_PERMUTED", False),
              ("WINDOWED", False), ("SOFTCAP", False)),
             8, 3, (("PIPELINE", True),),
             "H100 80GB HBM3, 2026-11-25: benchmarks/results/hopper-nvidia-h100-80gb-hbm3-"
             "2026-11-25-{1k,16k}.json, rows 'ours' (autotune) and 'ours cfg=…'; H200, "
             "2026-11-29: benchmarks/results/h200-2026-11-29/forward-nvidia-h200-2026-11-29.md, "
             "rows 'e2e triton token' (the autotuner's choice in 'note')"),
    Measured("_attn_fwd_int8_kernel", "sm_90",
             (("D", 64), ("BLOCK_N", 64), ("BLOCK_Q", 128), ("GRAN", 1), ("PV_FP8", True),
              ("VARLEN", False), ("V_PERMUTED", False), ("WINDOWED", False), ("SOFTCAP", False)),
             8, 3, (("PIPELINE", True),),
             "H200, 2026-11-29: benchmarks/results/h200-2026-11-29/forward-nvidia-h200-2026-11-29"
             ".md, rows 'e2e triton token' at D = 64, N = 1k, 8k, 16k and causal 16k (the "
             "autotuner's choice in 'note', 4 of 4)"),
)


# Launch arguments that change what a program masks or adds on the same tiles, not the tiles: a
# window's or a chunk's key range and per-row limits, softcap's tanh of each score, packed
# sequences' offsets. A launch that an entry matches on everything but these runs the entry's
# candidate, as causal launches run the non-causal rows' (IS_CAUSAL is in no match: the H100 and
# the H200 chose the same candidate causal or not, in all 12 rows), rather than autotuning each
# new length (autotuning a windowed launch took 10.7 and 17.0 s of its first call on the H200 of
# 2026-11-29, per-thread scales, D = 128 and 64); an entry of its own, from a run that times
# such launches, takes precedence (NOTES §23).
SAME_TILES = ("WINDOWED", "SOFTCAP", "VARLEN")


@dataclass(frozen=True)
class KernelChoice:
    """The kernel the default (``measured``) of the placement variable of ``option``
    (``core.options.VARIABLES``) runs on ``family``; ``source``: the GPU run that decided it."""

    option: str
    family: str
    kernel: str
    source: str


# The training backward (the trainable attention and video sparse attention's fine stage) on
# Hopper: the sm90 loops were faster on every row measured and passed their GPU tests and check.
# The forward (option "kernel"): no entry yet (the sm90 forward failed its check on the H200 of
# 2026-11-29); one is added when a GPU run's forward tests pass and its rows win.
KERNEL_CHOICES = (
    KernelChoice("bwd_kernel", "sm_90", "sm90",
                 "H200, 2026-11-29: benchmarks/results/h200-2026-11-29/decide2.md (bench_train, "
                 "D=128, N=4k/8k/16k, causal and not: sagebwd_int8 forward + backward 1.05-1.30x "
                 "faster on the sm90 loops than on the Triton backward, 6 rows of 6; bench_vsa "
                 "0.875: 15.7 ms against 19.9 ms) and sm90-bwd-tests.log (10 passed)"),
)


@dataclass(frozen=True)
class DecodeSplit:
    """How the KV-cache decode kernel (``kvcache/kernel_decode.py``) splits a sequence's keys on
    ``family``: ``tokens`` keys per split in place of its ``TOKENS_PER_SPLIT`` or, with
    ``parts`` > 0, each sequence's pages in ``parts`` splits; ``source``: the GPU run that
    decided it. Per architecture, never per batch: a sequence's splits then depend on its own
    length only, so its result is the same alone or in any batch."""

    family: str
    tokens: int | None
    source: str
    parts: int = 0


# None measured yet: ``bench_decode.py --splits`` times the candidates (decide2's decode step),
# and an entry comes from its rows (NOTES §13d).
DECODE_SPLITS: tuple[DecodeSplit, ...] = ()


def kernel_choice(option: str, family: str | None) -> str | None:
    """The kernel :data:`KERNEL_CHOICES` names for ``option`` on ``family``, or ``None`` (no
    measurement: the option's portable kernel)."""
    return next((c.kernel for c in KERNEL_CHOICES if c.option == option and c.family == family),
                None)


def decode_split(family: str | None) -> DecodeSplit | None:
    """The entry of :data:`DECODE_SPLITS` for ``family``, or ``None``."""
    return next((c for c in DECODE_SPLITS if c.family == family), None)


def measured(kernel: str, family: str | None, args: dict) -> Measured | None:
    """The entry of :data:`MEASURED` for a launch of ``kernel`` on ``family`` with ``args``: one
    that matches it, else one that matches it but for :data:`SAME_TILES`; or ``None``."""
    exact = next((m for m in MEASURED if m.applies(kernel, family, args)), None)
    if exact is not None:
        return exact
    return next((m for m in MEASURED if m.applies(kernel, family, args, SAME_TILES)), None)


__all__ = ["DECODE_SPLITS", "KERNEL_CHOICES", "MEASURED", "SAME_TILES", "DecodeSplit",
           "KernelChoice", "Measured", "decode_split", "kernel_choice", "measured"]
