"""Reading the SASS of a kernel compiled ahead of time (:mod:`lowbit_attn.tools.aot`), with the
``cuobjdump`` bundled in Triton's wheel: the instructions of each loop, and where the exp2s of a
softmax sit against the asynchronous tensor-core products.

On Hopper a ``wgmma`` is issued (``IGMMA``/``QGMMA``/``HGMMA`` in SASS) and waited for later
(``WARPGROUP.DEPBAR``); instructions between the two run while the tensor cores work. ::

    from lowbit_attn.tools import aot, sass
    report = aot.compile_launch(launch, "sm_90a", config=1)
    for body in sass.loops(sass.disassemble(report.cubin)):
        print(sass.exp2_under_mma(body))
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def cuobjdump_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def disassemble(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction (predicates stripped)."""
    if not cubin:
        raise ValueError("cubin is empty: the kernel did not compile")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([cuobjdump_path(), "-sass", path], capture_output=True, text=True,
                              timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {done.stderr.strip()[:300]}")
    return [(int(a, 16), _PREDICATE.sub("", text)) for a, text in _LINE.findall(done.stdout)]


def loops(instructions: list[tuple[int, str]]) -> list[list[str]]:
    """The bodies of the loops, in program order: from the target of each backward branch to the
    branch."""
    bodies = []
    for address, text in instructions:
        if not re.match(r"BRA\b", text):
            continue
        target = re.search(r"0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            lo = int(target.group(1), 16)
            bodies.append([t for a, t in instructions if lo <= a <= address])
    return bodies


def key_block_loops(instructions: list[tuple[int, str]], mma: str = "IGMMA") -> list[list[str]]:
    """The key-block loops of an attention kernel, in program order: the loops that issue
    ``mma`` and hold no smaller such loop. Only code before the last ``EXIT`` counts: the
    out-of-line retry stubs of mbarrier waits sit after it and branch backwards into the kernel,
    so :func:`loops` reads each as a loop around everything in between. A warp-specialized
    kernel has one copy of its loops per partition that runs them."""
    last_exit = max((a for a, t in instructions if re.match(r"EXIT\b", t)), default=None)
    spans = []
    for address, text in instructions:
        if not re.match(r"BRA\b", text) or (last_exit is not None and address > last_exit):
            continue
        target = re.search(r"0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            lo = int(target.group(1), 16)
            body = [t for a, t in instructions if lo <= a <= address]
            if any(t.startswith(mma) for t in body):
                spans.append((lo, address, body))
    return [body for lo, hi, body in spans
            if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b, _ in spans)]


def opcode_counts(body: list[str]) -> dict[str, int]:
    """Instructions per opcode (the text before the first ``.`` or space)."""
    counts: dict[str, int] = {}
    for text in body:
        op = re.split(r"[ .]", text, maxsplit=1)[0]
        counts[op] = counts.get(op, 0) + 1
    return counts


_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


@dataclass(frozen=True)
class Exp2Placement:
    """Where a loop's ``MUFU.EX2`` instructions sit against a group of asynchronous MMAs:
    ``before`` the first is issued, ``under`` them (after the first issue and before the
    ``WARPGROUP.DEPBAR`` that retires the group), ``after`` that wait. ``span``: instructions of
    any kind strictly between the first issue and that wait."""

    before: int
    under: int
    after: int
    span: int = 0

    @property
    def total(self) -> int:
        return self.before + self.under + self.after


def retiring_wait(body: list[str], last: int) -> int:
    """Index of the ``WARPGROUP.DEPBAR.LE gsb0, N`` that retires the wgmma group whose last
    instruction is ``body[last]`` (``len(body)`` if none does): groups complete in order, so it is
    the first wait after it that leaves at most N groups in flight, N being the number of groups
    committed since (each group's last wgmma carries ``gsb0``)."""
    later = 0
    for i in range(last + 1, len(body)):
        wait = _WAIT.match(body[i])
        if wait and int(wait.group(1), 16) <= later:
            return i
        if "GMMA" in body[i] and "gsb0" in body[i]:
            later += 1
    return len(body)


def exp2_under_mma(body: list[str], mma: str = "IGMMA") -> Exp2Placement | None:
    """Placement of the exp2s against the loop's ``mma`` group (``IGMMA``: INT8 wgmma,
    ``QGMMA``: FP8); ``None`` when the loop issues none."""
    issued = [i for i, t in enumerate(body) if t.startswith(mma)]
    if not issued:
        return None
    first, last = issued[0], issued[-1]
    wait = retiring_wait(body, last)

    def exp2s(lo: int, hi: int) -> int:
        return sum(t.startswith("MUFU.EX2") for t in body[lo:hi])

    return Exp2Placement(before=exp2s(0, first), under=exp2s(first, wait),
                         after=exp2s(wait, len(body)), span=max(wait - first - 1, 0))


@dataclass(frozen=True)
class MainLoop:
    """The unmasked key-block loop of an attention kernel: the first loop of its SASS (the masked
    tail's comes second). ``scores``: the scores one thread holds per tile (``block_m·block_n``
    over the program's threads), so that ``per_score`` is the per-thread instructions per tile
    over them, as ``benchmarks/NOTES.md`` §10–11 count."""

    body: list[str]
    scores: int

    @property
    def per_tile(self) -> int:
        return len(self.body)

    @property
    def per_score(self) -> float:
        return self.per_tile / self.scores


def main_loop(cubin: bytes, *, block_m: int, block_n: int, num_warps: int) -> MainLoop:
    """The :class:`MainLoop` of a compiled attention kernel (``ValueError`` if it has no loop)."""
    bodies = loops(disassemble(cubin))
    if not bodies:
        raise ValueError("the kernel's SASS has no loop")
    return MainLoop(bodies[0], block_m * block_n // (32 * num_warps))


_REGISTER = re.compile(r"\bR(\d+)\b")


def _destination(text: str) -> int | None:
    """The first general register an instruction names before its first comma (its destination
    for ALU, load and MMA instructions; stores and branches name none there)."""
    parts = text.split(None, 1)
    if len(parts) < 2:
        return None
    found = _REGISTER.match(parts[1].split(",", 1)[0].strip())
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class QKInterleave:
    """What sits among a loop's Q·Kᵀ ``mma.sync`` instructions (``OMMA`` on sm_120): strictly
    between the first and the last of them, ``exp2`` (``MUFU.EX2``), E2M1 conversions (``F2FP``
    with ``E2M1``) and instructions of any kind other than ``OMMA`` (``other``). ``qk``/``pv``:
    how many ``OMMA`` each product has."""

    qk: int
    pv: int
    exp2: int
    f2fp: int
    other: int


def qk_interleave(body: list[str], mma: str = "OMMA") -> QKInterleave:
    """Tell a loop's ``mma`` instructions of Q·Kᵀ from those of P̃·V by their A operand: Q comes
    straight from shared memory (its last writer in the body is an ``LDSM``) or is loop-invariant
    (no writer in the body), P̃ is computed in the loop (converted, shuffled, permuted)."""
    qk, pv = [], []
    for i, text in enumerate(body):
        if not text.startswith(mma):
            continue
        a = _REGISTER.findall(text)[1]  # destination, A, B, C, scales
        writer = next((body[j] for j in range(i - 1, -1, -1)
                       if _destination(body[j]) == int(a)), None)
        (qk if writer is None or writer.startswith("LDSM") else pv).append(i)
    if not qk:
        return QKInterleave(0, len(pv), 0, 0, 0)
    span = body[qk[0] + 1:qk[-1]]
    return QKInterleave(
        qk=len(qk), pv=len(pv), exp2=sum(t.startswith("MUFU.EX2") for t in span),
        f2fp=sum(t.startswith("F2FP") and "E2M1" in t for t in span),
        other=sum(not t.startswith(mma) for t in span),
    )
