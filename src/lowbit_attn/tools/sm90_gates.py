"""What the one-warpgroup Hopper forward (``inference/kernel_int8_sm90.py``) shows compiled for
sm_90a: the gate ``lowbit-attn inspect --kernel sm90`` prints and
``tests/inference/test_aot_sm90.py`` holds.

- P̃·V is a wgmma whose A operand comes from registers (its PTX names a register list where a
  shared-memory descriptor would be);
- the main (unmasked) key-block loop stores nothing to shared memory;
- no instruction writes a register an in-flight wgmma reads as its A operand, before the wait
  that retires it (``sass.a_register_hazards``, over the whole kernel): Triton leaves a register
  A operand out of the wait's dependencies, so nothing else checks it;
- no E4M3 pack merges a register that no pack wrote (``sass.stale_merges``: ptxas 12.8 did so
  in a one-key launch's constant-folded P̃, NOTES §27);
- no spills;
- at most :data:`MAX_PER_SCORE` instructions per score in that loop (per thread: the loop's
  instructions over the 64 scores a thread holds per 64×128 tile);
- at least :data:`MIN_CTAS` programs fit on one SM by registers, shared memory and threads.

The SM's limits are those of compute capability 9.0 (CUDA C Programming Guide, "Technical
Specifications per Compute Capability", and the Hopper tuning guide): 64 Ki 32-bit registers,
228 KiB of shared memory of which each resident block also reserves 1 KiB, 2048 threads, 32
blocks; registers are allocated per warp in units of 256.
"""

from __future__ import annotations

import re

from lowbit_attn.tools import sass

KERNEL = "_attn_fwd_sm90_kernel"
MAX_PER_SCORE = 8.0
MIN_CTAS = 2
THREADS = 128  # one warpgroup
SCORES_PER_THREAD = 64 * 128 // THREADS

REGISTERS_PER_SM = 64 * 1024
REGISTER_UNIT = 256  # per warp
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024
THREADS_PER_SM = 2048
CTAS_PER_SM = 32

_PV = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32\.(?:e4m3\.e4m3|f16\.f16)\s+"
                 r"\{[^}]*\},\s*(\S)")


def ctas_per_sm(registers: int, shared: int, threads: int = THREADS) -> int:
    """How many blocks of ``threads`` threads, ``registers`` per thread and ``shared`` bytes of
    shared memory one Hopper SM holds at once."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED_PER_CTA)
    return min(by_registers, by_shared, THREADS_PER_SM // threads, CTAS_PER_SM)


def pv_from_registers(ptx: str) -> bool | None:
    """Whether every P̃·V wgmma (E4M3 or fp16 operands, fp32 accumulator) takes its A operand
    from registers; ``None`` when the PTX has none."""
    found = _PV.findall(ptx)
    return all(first == "{" for first in found) if found else None


def a_register_gate(listing: list[tuple[int, str, str]]) -> dict:
    """``sass.a_register_hazards`` of a kernel's SASS as gate fields: ``wgmma`` (those with a
    register A operand) and ``hazards`` (each as text)."""
    found = sass.a_register_hazards(listing)
    return {"wgmma": found.wgmma, "hazards": [str(h) for h in found.hazards]}


def a_register_line(found: dict) -> str:
    """The ``inspect`` line of :func:`a_register_gate`'s fields."""
    a = found["a_register"]
    hazards = "none" if not a["hazards"] else f"{len(a['hazards'])} (first: {a['hazards'][0]})"
    return (f"  A registers   A-register hazard: {hazards} ({a['wgmma']} wgmma with register A "
            "checked)")


def gates(report) -> dict | None:
    """The kernel's gates (module docstring); ``None`` when it did not compile."""
    if not report.ok or not report.cubin:
        return None
    c = report.constexprs
    pv_mma = "QGMMA" if c["PV_FP8"] else "HGMMA"
    listing = sass.listing(report.cubin)
    body = sass.key_block_loops([(a, t) for a, _, t in listing], mma=pv_mma)[0]
    ops = sass.opcode_counts(body)
    per_score = len(body) / SCORES_PER_THREAD
    ctas = ctas_per_sm(report.registers, report.shared_memory)
    found = {
        "per_tile": len(body), "per_score": round(per_score, 2),
        "scores_per_thread": SCORES_PER_THREAD, "exp2": sum(t.startswith("MUFU.EX2") for t in body),
        "i2f": sum(t.startswith(("I2F", "I2FP")) for t in body),
        "shared_stores": ops.get("STS", 0), "local_memory": ops.get("LDL", 0) + ops.get("STL", 0),
        "pv_from_registers": pv_from_registers(report.ptx), "ctas_per_sm": ctas,
        "spills": report.spills, "a_register": a_register_gate(listing),
        "stale_merges": len(sass.stale_merges(listing)),
    }
    found["checks"] = {
        "P̃·V from registers": found["pv_from_registers"] is True,
        "no A-register hazard": not found["a_register"]["hazards"],
        "no stale E4M3 merge": found["stale_merges"] == 0,
        "no shared-memory store in the main loop": found["shared_stores"] == 0,
        "0 spills": report.spills == 0,
        f"<= {MAX_PER_SCORE} instructions per score": per_score <= MAX_PER_SCORE,
        f">= {MIN_CTAS} CTAs per SM": ctas >= MIN_CTAS,
    }
    found["passes"] = all(found["checks"].values())
    return found


def verdict(found: dict, failing: str = "fails") -> str:
    """``"passes"``, or ``failing`` and the checks of ``found["checks"]`` that failed."""
    failed = [name for name, ok in found["checks"].items() if not ok]
    return "passes" if not failed else f"{failing}: " + "; ".join(failed)


def format_gates(report, found: dict | None) -> list[str]:
    """Lines for ``inspect``."""
    if found is None:
        return []
    verdict_ = verdict(found)
    return [
        f"  main loop     {found['per_tile']} instructions per tile, {found['per_score']:.2f} per "
        f"score ({found['scores_per_thread']} scores per thread), {found['exp2']} exp2, "
        f"{found['shared_stores']} shared-memory stores, {found['local_memory']} local-memory "
        "accesses",
        f"  P̃·V A operand  {'registers' if found['pv_from_registers'] else 'shared memory'}; "
        f"{found['ctas_per_sm']} CTAs per SM ({report.registers} registers, "
        f"{report.shared_memory} B shared memory, {THREADS} threads)",
        a_register_line(found),
        f"  gate          {verdict_} (P̃·V from registers, no A-register hazard, no STS in the "
        f"loop, 0 spills, <= {MAX_PER_SCORE} per score, >= {MIN_CTAS} CTAs per SM)",
    ]
