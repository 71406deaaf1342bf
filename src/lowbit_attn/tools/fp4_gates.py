"""What the compiled FP4 attention kernels show in their SASS: the gates ``lowbit-attn inspect``
prints for ``--recipe qk_fp4_pv_fp4`` / ``qk_mxfp4_pv_mxfp4`` on sm_100a and sm_120a, and that
``tests/inference/test_aot_fp4*.py`` hold.

- The Triton kernel (``inference/kernel_fp4.py``): its unmasked key-block loop, instructions per
  tile and per score, the exp2s and the hardware E2M1 conversions in it; on sm_120a, where it
  issues the next block's Q·Kᵀ before the softmax (``PIPELINE_QK``), the work between that
  product's first and last ``OMMA``.
- The Gluon kernel for sm_100a (``inference/kernel_fp4_gluon.py``): the softmax partition's
  unmasked loop (instructions per tile and per score, exp2s, conversions) and how long each
  product has to run: from the arrive that lets the MMA warp issue it to the softmax's wait for
  its result, in instructions of that loop (a whole step means no wait between an MMA's issue and
  the next softmax's start); the MMA warp's loop and its ``UTCOMMA`` / ``UTCCP``.

"Per score" is per thread: the loop's instructions over the scores one thread holds per tile
(``BLOCK_M·BLOCK_N`` over the softmax's threads), as ``benchmarks/NOTES.md`` §7 counts; a
warp-instruction count per score is that over 32.
"""

from __future__ import annotations

from lowbit_attn.tools import sass

E2M1_CONVERSION = "F2FP.SATFINITE.E2M1"
GLUON_FP4_KERNEL = "_attn_fwd_fp4_gluon_kernel"
SOFTMAX_THREADS = 128  # kernel_fp4_gluon: the default partition, 4 warps, one row per thread


def _counts(body: list[str]) -> dict:
    return {"exp2": sum(t.startswith("MUFU.EX2") for t in body),
            "e2m1_conversions": sum(t.startswith(E2M1_CONVERSION) for t in body),
            "local_memory": sum(t.startswith(("LDL", "STL")) for t in body)}


def triton_gates(report) -> dict | None:
    """The Triton FP4 kernel's key-block loop on sm_100a (the first loop with a ``UTCOMMA``) or
    sm_120a (the first loop); ``None`` when it did not compile or is not native FP4."""
    c = report.constexprs
    if not report.ok or not report.cubin or not c.get("NATIVE_FP4"):
        return None
    instructions = sass.disassemble(report.cubin)
    sm100 = report.arch.startswith("sm_100")
    body = (sass.key_block_loops(instructions, mma="UTCOMMA") if sm100
            else sass.loops(instructions))[0]
    scores = c["BLOCK_M"] * c["BLOCK_N"] // (32 * report.num_warps)
    gates = {"per_tile": len(body), "scores_per_thread": scores,
             "per_score": round(len(body) / scores, 2), **_counts(body)}
    if not sm100:
        qk = sass.qk_interleave(body)
        gates["pipeline_qk"] = bool(c.get("PIPELINE_QK"))
        gates["under_qk"] = {"omma": qk.qk, "exp2": qk.exp2, "instructions": qk.other}
    return gates


def product_spans(body: list[str]) -> dict | None:
    """Where the Gluon softmax loop ``body`` lets each product start and waits for it (indices
    into the loop) and how many of its instructions each product has to run, from the arrive
    that enables it, around the loop, to the wait for its result one step later; ``None`` unless
    the loop has the kernel's four arrives and two waits (:func:`gluon_gates`)."""
    arrives = [i for i, t in enumerate(body) if t.startswith("SYNCS.ARRIVE")]
    waits = [i for i, t in enumerate(body) if t.startswith("SYNCS.PHASECHK")]
    if len(arrives) != 4 or len(waits) != 2:
        return None
    ks_ready, _, p_ready, _ = arrives
    s_wait, pv_wait = waits
    n = len(body)
    return {"ks_ready": ks_ready, "s_wait": s_wait, "p_ready": p_ready, "pv_wait": pv_wait,
            "qk_span": n - ks_ready + s_wait, "pv_span": n - p_ready + pv_wait}


def gluon_gates(report) -> dict | None:
    """The Gluon FP4 kernel's gates (module docstring); ``None`` when it did not compile.

    The softmax loop's arrives come in program order — K(j+1)'s scales published (S(j+1) may be
    issued), S(j) read, P̃(j) written (P̃(j)·V(j) may be issued), PV(j−1) read — and its waits
    are S(j) and PV(j−1): each product is waited for one step after the arrive that enables it,
    so its span wraps around the loop."""
    if not report.ok or not report.cubin:
        return None
    c = report.constexprs
    instructions = sass.disassemble(report.cubin)
    loops = sass.key_block_loops(instructions, mma="MUFU.EX2")
    body = loops[0]  # the unmasked loop (the masked one comes second)
    scores = c["BLOCK_M"] * c["BLOCK_N"] // SOFTMAX_THREADS
    gates = {"per_tile": len(body), "scores_per_thread": scores,
             "per_score": round(len(body) / scores, 2), **_counts(body)}
    spans = product_spans(body)
    if spans is not None:
        gates["qk_span"], gates["pv_span"] = spans["qk_span"], spans["pv_span"]
        gates["exp2_under_both"] = sum(t.startswith("MUFU.EX2")
                                       for t in body[spans["s_wait"]:spans["p_ready"]])
    mma = sass.key_block_loops(instructions, mma="UTCOMMA")
    if mma:
        ops = sass.opcode_counts(mma[0])
        gates["mma_warp"] = {"per_block": len(mma[0]), "utcomma": ops.get("UTCOMMA", 0),
                             "utccp": ops.get("UTCCP", 0)}
    return gates


def format_gates(report, gates: dict | None) -> list[str]:
    """Lines for ``inspect`` (none when there are no gates)."""
    if gates is None:
        return []
    who = "softmax partition" if report.kernel == GLUON_FP4_KERNEL else "key-block loop"
    lines = [f"  {who}  {gates['per_tile']} instructions per tile and thread, "
             f"{gates['per_score']:.2f} per score ({gates['scores_per_thread']} scores per thread); "
             f"{gates['exp2']} exp2, {gates['e2m1_conversions']} E2M1 conversions "
             f"({E2M1_CONVERSION}), {gates['local_memory']} local-memory accesses"]
    if "under_qk" in gates:
        u = gates["under_qk"]
        lines.append(f"  next Q·Kᵀ issued before the softmax: {'yes' if gates['pipeline_qk'] else 'no'}"
                     f"; between its first and last of {u['omma']} OMMA: {u['exp2']} exp2, "
                     f"{u['instructions']} instructions")
    if "qk_span" in gates:
        lines.append(f"  products in flight: Q·Kᵀ over {gates['qk_span']} and P̃·V over "
                     f"{gates['pv_span']} softmax instructions (the loop: {gates['per_tile']}) "
                     f"from the arrive that lets the MMA warp issue them to the softmax's wait; "
                     f"{gates['exp2_under_both']} exp2 under both")
    if "mma_warp" in gates:
        m = gates["mma_warp"]
        lines.append(f"  MMA warp      {m['per_block']} instructions per key block, "
                     f"{m['utcomma']} UTCOMMA, {m['utccp']} UTCCP")
    return lines
