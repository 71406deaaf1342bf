"""What the Gluon backward loops for Hopper (``training/kernel_bwd_sm90.py``: dK/dV, dQ and the
Δ pass, for the trainable attention and VSA's fine stage) show compiled for sm_90a: the gate
``lowbit-attn inspect --kernel sm90 --recipe sagebwd_int8`` (or ``--recipe vsa``) prints and
``tests/training/test_aot_bwd_sm90.py`` holds.

Per tile of the main loop (``64·NUM_WG`` keys by 64 queries for dK/dV, ``64·NUM_WG`` queries by
64 keys for dQ and Δ), the model of ``benchmarks/NOTES.md`` §8:

- **tensor cycles**: the tile's products' multiply-adds over the SM's measured rates (H100,
  2026-11-22: INT8 ``torch._int_mm`` 916 TOP/s, bf16 GEMM 792 TFLOP/s, 132 SMs at 1.83 GHz:
  :data:`INT8_MACS` and :data:`BF16_MACS` per clock per SM);
- **issue cycles**: the loop's instructions per thread (per warp) times the program's warps over
  the SM's four schedulers (one program per SM: these kernels take more than half its
  registers or shared memory);
- the gate: no spills, every product a wgmma of N >= 64, no instruction writing a register an
  in-flight wgmma reads as its A operand (``sm90_gates.a_register_gate``, the whole kernel), and
  issue cycles at most :data:`MAX_ISSUE_RATIO` times the tensor cycles.

The main loop is the shortest of the kernel's key-block (or query-tile) loops: the masked one
(causal diagonal, a sequence's last tile) holds the same work and the masks. Also shown, for
the prediction: MUFU cycles (exp2 and reciprocals at 16 per clock per SM) and conversion cycles
(``I2F``/``F2I``, 16 per clock per SM), which the issue model does not count.
"""

from __future__ import annotations

from lowbit_attn.tools import sass, sm90_gates

KERNELS = ("_dkdv_sm90_kernel", "_dq_sm90_kernel")
INT8_MACS = 916e12 / 2 / (132 * 1.83e9)  # ≈ 1896 per clock per SM
BF16_MACS = 792e12 / 2 / (132 * 1.83e9)  # ≈ 1640
MUFU_PER_CLOCK = 16
CONVERSIONS_PER_CLOCK = 16
SCHEDULERS = 4
MAX_ISSUE_RATIO = 1.5
WIDE_N = 64


def products(report) -> list[tuple[str, bool, int]]:
    """``(name, INT8?, multiply-adds)`` of each product of one tile of the kernel's main loop."""
    c = report.constexprs
    rows, d, int8 = 64 * c["NUM_WG"], c["BLOCK_D"], c["INT8"]
    macs = rows * 64 * d
    if report.kernel == "_dkdv_sm90_kernel":
        return [("Sᵀ = K·Qᵀ", int8, macs), ("dPᵀ = V·dOᵀ", False, macs),
                ("dV += Pᵀ·dO", int8, macs), ("dK += dSᵀ·Q", int8, macs)]
    found = [("S = Q·Kᵀ", int8, macs), ("dP = dO·Vᵀ", False, macs)]
    return found if c["DELTA_PASS"] else found + [("dQ += dS·K", int8, macs)]


def gates(report) -> dict | None:
    """The kernel's loop counts and gate (module docstring); ``None`` when it did not compile."""
    if not report.ok or not report.cubin:
        return None
    mma = "IGMMA" if report.constexprs["INT8"] else "HGMMA"
    listing = sass.listing(report.cubin)
    loops = sass.key_block_loops([(a, t) for a, _, t in listing], mma=mma)
    body = min(loops, key=len)
    ops = sass.opcode_counts(body)
    tensor = sum(m / (INT8_MACS if i8 else BF16_MACS) for _, i8, m in products(report))
    issue = len(body) * report.num_warps / SCHEDULERS
    warps = report.num_warps
    found = {
        "per_tile": len(body), "tensor_cycles": round(tensor), "issue_cycles": round(issue),
        "ratio": round(issue / tensor, 2),
        "mufu_cycles": round(ops.get("MUFU", 0) * warps * 32 / MUFU_PER_CLOCK),
        "conversion_cycles": round(sum(n for op, n in ops.items() if op in ("I2F", "I2FP", "F2I"))
                                   * warps * 32 / CONVERSIONS_PER_CLOCK),
        "shared_loads": ops.get("LDS", 0), "shared_stores": ops.get("STS", 0),
        "local_memory": ops.get("LDL", 0) + ops.get("STL", 0), "barriers": ops.get("BAR", 0),
        "spills": report.spills, "narrow": report.narrow_products(WIDE_N),
        "a_register": sm90_gates.a_register_gate(listing),
    }
    found["checks"] = {
        "0 spills": report.spills == 0,
        f"every product a wgmma of N >= {WIDE_N}": not found["narrow"],
        "no A-register hazard": not found["a_register"]["hazards"],
        f"issue <= {MAX_ISSUE_RATIO}x tensor cycles per tile": issue <= MAX_ISSUE_RATIO * tensor,
    }
    found["passes"] = all(found["checks"].values())
    return found


def format_gates(report, found: dict | None) -> list[str]:
    """Lines for ``inspect``."""
    if found is None:
        return []
    return [
        f"  main loop     {found['per_tile']} instructions per thread per tile; issue "
        f"{found['issue_cycles']} cycles against tensor {found['tensor_cycles']} "
        f"({found['ratio']:.2f}x); MUFU {found['mufu_cycles']}, conversions "
        f"{found['conversion_cycles']} cycles; {found['shared_loads']} LDS, "
        f"{found['shared_stores']} STS, {found['barriers']} BAR, {found['local_memory']} "
        "local-memory accesses",
        sm90_gates.a_register_line(found),
        f"  gate          {sm90_gates.verdict(found, 'misses')} (0 spills, every product a wgmma "
        f"of N >= {WIDE_N}, no A-register hazard, issue <= {MAX_ISSUE_RATIO}x tensor cycles per "
        "tile)",
    ]


__all__ = ["BF16_MACS", "INT8_MACS", "KERNELS", "MAX_ISSUE_RATIO", "format_gates", "gates",
           "products"]
