"""Reading the SASS of a kernel compiled ahead of time (:mod:`lowbit_attn.tools.aot`), with the
``cuobjdump`` bundled in Triton's wheel: the instructions of each loop, and where the exp2s of a
softmax sit against the asynchronous tensor-core products.

On Hopper a ``wgmma`` is issued (``IGMMA``/``QGMMA``/``HGMMA`` in SASS) and waited for later
(``WARPGROUP.DEPBAR``); instructions between the two run while the tensor cores work, and must
not write the registers a wgmma reads as its A operand (:func:`a_register_hazards`). ::

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


def parse(text: str) -> list[tuple[int, str, str]]:
    """``(address, guard predicate or "", instruction)`` of each line ``/*0040*/ @P0 BRA 0x80 ;``
    of ``cuobjdump -sass`` output (or of SASS written in that form)."""
    found = []
    for a, line in _LINE.findall(text):
        guard = _PREDICATE.match(line)
        found.append((int(a, 16), guard.group(0).strip() if guard else "",
                      line[guard.end():] if guard else line))
    return found


def listing(cubin: bytes) -> list[tuple[int, str, str]]:
    """:func:`parse` of the cubin's SASS."""
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
    return parse(done.stdout)


def disassemble(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction (predicates stripped)."""
    return [(a, text) for a, _, text in listing(cubin)]


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


def attention_loops(cubin: bytes, *, block_m: int, block_n: int,
                    num_warps: int) -> list[tuple[int, float]]:
    """``(instructions per tile and thread, per score)`` of each key-block loop of a Triton
    attention kernel, in program order: the loops that issue its Q·Kᵀ (``IGMMA`` on sm_90a,
    ``IMMA`` before), each holding no smaller such loop. A score is one of the
    ``block_m·block_n`` a tile computes, over the program's threads."""
    instructions = disassemble(cubin)
    mma = "IGMMA" if any(t.startswith("IGMMA") for _, t in instructions) else "IMMA"
    scores = block_m * block_n // (32 * num_warps)
    return [(len(body), len(body) / scores) for body in key_block_loops(instructions, mma=mma)]


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


# --- wgmma register A operands ---------------------------------------------------------------
#
# A wgmma whose A operand sits in registers (``QGMMA.64x128x32.F32.E4M3.E4M3 R24, R104, gdesc[UR4],
# R24``: destination, A, B's descriptor, accumulator) reads them while it is in flight: from its
# issue until a ``WARPGROUP.DEPBAR.LE gsb0, N`` retires its group (each group's last wgmma carries
# ``gsb0``; the wait leaves at most the N newest committed groups in flight). An instruction that
# writes one of those registers in between changes what the tensor cores multiply.

_GMMA = re.compile(r"([HIQ]GMMA)\.64x(\d+)x(\d+)\b")
_A_REGISTERS = 4  # m64 by 32 bytes of K over the 128 threads: 16 bytes per thread
_K_OF = {"IGMMA": (32,), "QGMMA": (32,), "HGMMA": (16, 8)}  # 32 bytes of 8/16/32-bit elements
_GUARD = re.compile(r"!?U?P(\d+|T)$")
_NO_REGISTER_WRITE = ("BRA", "EXIT", "BSSY", "BSYNC", "BREAK", "WARPSYNC", "BAR", "NOP",
                      "DEPBAR", "WARPGROUP", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "BPT", "YIELD",
                      "CALL", "RET")
_UNANALYSED = ("BRX", "JMX", "JMP")  # indirect or absolute jumps: not in the kernels
_K_CAP = 16  # commits counted past the largest N a wait can name


def _operands(text: str) -> list[str]:
    parts = text.split(None, 1)
    return [o.strip() for o in parts[1].split(",")] if len(parts) > 1 else []


def _written(text: str) -> set[int]:
    """The general registers an instruction may write (more rather than fewer): its first operand
    that is not a predicate, when a register, with the registers a wide result takes."""
    opcode = text.split(None, 1)[0]
    if opcode.split(".")[0] in _NO_REGISTER_WRITE:
        return set()
    dest = next((o for o in _operands(text) if not _GUARD.match(o)), None)
    found = _REGISTER.match(dest or "")
    if not found:
        return set()
    gmma = _GMMA.match(opcode)
    if gmma:
        width = int(gmma.group(2)) // 2  # the accumulator: N/2 fp32 or s32 per thread
    elif opcode.startswith(("HMMA", "IMMA", "QMMA", "OMMA")) or re.search(r"\.128\b|88\.4\b",
                                                                          opcode):
        width = 4
    elif (re.search(r"\.64\b|WIDE|F64|88\.2\b", opcode) or opcode in ("CS2R", "CS2R.64")
          or opcode.split(".")[0] in ("DADD", "DMUL", "DFMA")):
        width = 2
    else:
        width = 1
    return set(range(int(found.group(1)), int(found.group(1)) + width))


def _register_a(text: str) -> tuple[int, ...] | None:
    """The registers of a wgmma's A operand (``None``: not a wgmma, or A in shared memory)."""
    found = _GMMA.match(text)
    if not found:
        return None
    if int(found.group(3)) not in _K_OF[found.group(1)]:
        raise ValueError(f"a wgmma of K = {found.group(3)} is not one this check knows: {text}")
    a = _REGISTER.match(_operands(text)[1])  # (R104 or R104.reuse; B is gdesc[...])
    return tuple(range(int(a.group(1)), int(a.group(1)) + _A_REGISTERS)) if a else None


def _successors(i: int, listing: list[tuple[int, str, str]], index: dict[int, int],
                returns: list[int]) -> list[int]:
    """Where control may go after ``listing[i]``; ``returns``: the instruction after each call
    (a return may go to any: the subroutines, ptxas's slow paths of a division or a square root,
    are followed once for all their callers)."""
    address, guard, text = listing[i]
    opcode = text.split(None, 1)[0]
    name = opcode.split(".")[0]
    if name in _UNANALYSED:
        raise ValueError(f"control flow this check does not follow at {address:#x}: {text}")
    conditional = bool(guard) or any(_GUARD.match(o) for o in _operands(text)) or "." in opcode
    after = [i + 1] if i + 1 < len(listing) else []
    if name == "EXIT":
        return after if guard else []
    if name == "RET":
        return returns + (after if guard else [])
    if name in ("BRA", "CALL"):
        target = int(re.findall(r"0x([0-9a-f]+)", text)[-1], 16)
        if target not in index:
            raise ValueError(f"a branch at {address:#x} to {target:#x}, no instruction")
        falls = bool(guard) if name == "CALL" else conditional
        return [index[target]] + (after if falls else [])
    return after


@dataclass(frozen=True)
class AHazard:
    """An instruction (at ``address``) that may write ``register`` while the wgmma at ``wgmma``
    reads it as its A operand (issued, its group not yet retired)."""

    address: int
    instruction: str
    register: int
    wgmma: int

    def __str__(self) -> str:
        return (f"{self.address:#06x} {self.instruction} writes R{self.register}, A of the wgmma "
                f"at {self.wgmma:#06x} in flight")


@dataclass(frozen=True)
class ARegisterCheck:
    """What :func:`a_register_hazards` found: ``wgmma``, how many wgmma instructions take their A
    operand from registers (reachable ones); ``hazards``, the writes to such a register in
    flight."""

    wgmma: int
    hazards: tuple[AHazard, ...]

    @property
    def ok(self) -> bool:
        return not self.hazards

    def line(self) -> str:
        found = "none" if self.ok else f"{len(self.hazards)} (first: {self.hazards[0]})"
        return f"A-register hazard: {found} ({self.wgmma} wgmma with register A checked)"


def a_register_hazards(listing: list[tuple[int, str, str]]) -> ARegisterCheck:
    """Every instruction that may write a register some wgmma in flight reads as its A operand,
    on any path of the kernel's control flow (a forward data-flow over the SASS from its first
    instruction to a fixed point: per register, the wgmma reading it and the fewest groups
    committed since, on any path reaching the point; branches whose target is in the listing,
    both ways when guarded; a subroutine's return to every call's next instruction; indirect
    jumps refused). A guarded write counts as a write; a guarded wait retires nothing; a guarded
    wgmma is issued but commits nothing. ``listing``: :func:`listing` (or :func:`parse`)
    output."""
    index = {a: i for i, (a, _, _) in enumerate(listing)}
    returns = [i + 1 for i, (_, _, t) in enumerate(listing)
               if t.startswith("CALL") and i + 1 < len(listing)]
    states: dict[int, dict[int, tuple[int, int]]] = {0: {}} if listing else {}
    work = [0] if listing else []
    hazards: dict[tuple[int, int], AHazard] = {}
    register_a: set[int] = set()
    while work:
        i = work.pop()
        address, guard, text = listing[i]
        state = dict(states[i])  # register -> (commits since its wgmma, the wgmma's address)
        for r in sorted(_written(text) & state.keys()):
            hazards.setdefault((address, r), AHazard(address, text, r, state[r][1]))
        wait = _WAIT.match(text)
        if wait and not guard:
            state = {r: v for r, v in state.items() if v[0] <= int(wait.group(1), 16)}
        a = _register_a(text)
        if a is not None:
            register_a.add(address)
            for r in a:
                state[r] = min(state.get(r, (0, address)), (0, address))
        if _GMMA.match(text) and "gsb0" in _operands(text) and not guard:
            state = {r: (min(k + 1, _K_CAP), w) for r, (k, w) in state.items()}
        for j in _successors(i, listing, index, returns):
            old = states.get(j)
            if old is None:
                new = state
            else:
                new = dict(old)
                for r, v in state.items():
                    new[r] = min(new.get(r, v), v)
            if old is None or new != old:
                states[j] = new
                work.append(j)
    ordered = sorted(hazards.values(), key=lambda h: (h.address, h.register))
    return ARegisterCheck(len(register_a), tuple(ordered))


# --- E4M3 packs -------------------------------------------------------------------------------
#
# ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C Rd, Ra, Rb, Rc`` writes two E4M3 bytes of Ra, Rb in
# Rd's low half and Rc's low half in its high half: four bytes take two, the first with Rc = RZ.
# ptxas 12.8 (Triton 3.6's) has packed a kernel's constant-folded P̃ (one key: every masked column
# one value) from an Rc it never wrote (a Q scale's low bits: NaN rows, NOTES' one-key failure).

def stale_merges(listing: list[tuple[int, str, str]]) -> list[tuple[int, str, str | None]]:
    """``(address, instruction, Rc's last writer)`` of each ``F2FP ... MERGE_C`` whose Rc (not
    ``RZ``) was last written, in listing order, by something other than an ``F2FP`` or a
    ``PRMT`` (or by nothing). The packs are straight-line code: listing order is enough."""
    last: dict[int, str] = {}
    found = []
    for address, _, text in listing:
        if text.startswith("F2FP") and "MERGE_C" in text:
            c = _REGISTER.match(_operands(text)[3])
            if c and not last.get(int(c.group(1)), "").startswith(("F2FP", "PRMT")):
                found.append((address, text, last.get(int(c.group(1)))))
        for r in _written(text):
            last[r] = text
    return found


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
