"""``tools/sass.py``'s check that no instruction writes a register an in-flight wgmma reads as its A
operand (``a_register_hazards``), on SASS written here in ``cuobjdump``'s form: straight line,
loops, branches around the wait, operand widths. ``tests/inference/test_aot_sm90.py`` runs it on
the compiled kernels and on a compiled Gluon loop that has such a hazard."""

from __future__ import annotations

import pytest

from lowbit_attn.tools import sass


def check(code: str) -> sass.ARegisterCheck:
    lines = [line.strip() for line in code.strip().splitlines()]
    return sass.a_register_hazards(sass.parse("\n".join(
        f"/*{16 * i:04x}*/ {line} ;" for i, line in enumerate(lines))))


def written(found: sass.ARegisterCheck) -> list[tuple[int, int]]:
    return [(h.address, h.register) for h in found.hazards]


PV = "QGMMA.64x128x32.F32.E4M3.E4M3 R24, R104, gdesc[UR4], RZ, !UPT, gsb0"


def test_a_write_before_the_wait_is_a_hazard():
    found = check(f"""
        WARPGROUP.ARRIVE
        {PV}
        F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R107, R1, R2, R107
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        EXIT""")
    assert written(found) == [(0x20, 107)] and found.wgmma == 1
    assert "0x0020 F2FP" in found.line() and "wgmma at 0x0010" in found.line()


def test_writes_after_the_wait_or_beside_the_operand_are_not():
    found = check(f"""
        {PV}
        MOV R108, R1
        MOV R103, R1
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R104, R1
        EXIT""")
    assert found.ok and found.line() == \
        "A-register hazard: none (1 wgmma with register A checked)"


def test_wide_and_second_destinations_count():
    found = check(f"""
        {PV}
        IMAD.WIDE.U32 R103, R1, 0x4, R2
        SHFL.BFLY PT, R105, R1, 0x1, 0x1f
        LDS.128 R106, [R2]
        STS [R104], R1
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        EXIT""")
    assert written(found) == [(0x10, 104), (0x20, 105), (0x30, 106), (0x30, 107)]


def test_a_wait_leaves_the_newest_groups_in_flight():
    code = """
        {first}
        {second}
        WARPGROUP.DEPBAR.LE gsb0, 0x1
        MOV R104, RZ
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        EXIT"""
    qk = "IGMMA.64x128x32.S8.S8 R152, gdesc[UR8], RZ, !UPT, gsb0"
    assert check(code.format(first=PV, second=qk)).ok  # P̃·V's group, the older, retired
    assert written(check(code.format(first=qk, second=PV))) == [(0x30, 104)]


def test_an_uncommitted_wgmma_is_in_flight_past_any_wait():
    found = check("""
        QGMMA.64x128x32.F32.E4M3.E4M3 R24, R104, gdesc[UR4], RZ, !UPT
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R105, RZ
        QGMMA.64x128x32.F32.E4M3.E4M3 R24, R108, gdesc[UR4], R24, gsb0
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R105, RZ
        EXIT""")
    assert written(found) == [(0x20, 105)]


def test_a_deferred_wait_in_a_loop_is_a_hazard_on_the_next_pass():
    loop = """
        F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R104, R1, R2, R104
        QGMMA.64x128x32.F32.E4M3.E4M3 R24, R104, gdesc[UR4], RZ, !UPT, gsb0
        WARPGROUP.DEPBAR.LE gsb0, {n}
        @P0 BRA 0x0
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        EXIT"""
    assert check(loop.format(n="0x0")).ok
    assert written(check(loop.format(n="0x1"))) == [(0x0, 104)]  # P̃ of the next pass
    # a newer group committed before the wait: "at most 1 in flight" retires P̃·V's
    assert check(loop.replace("WARPGROUP.DEPBAR.LE gsb0, {n}",
                              "IGMMA.64x128x32.S8.S8 R152, gdesc[UR8], RZ, !UPT, gsb0\n"
                              "WARPGROUP.DEPBAR.LE gsb0, 0x1")).ok


def test_a_branch_around_the_wait_is_followed():
    found = check(f"""
        {PV}
        @P0 BRA 0x40
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R106, RZ
        MOV R105, RZ
        EXIT""")
    # a wgmma's accumulator counts as a write (here over the A operand of the one in flight)
    assert written(check(f"""
        {PV}
        IGMMA.64x128x32.S8.S8 R88, gdesc[UR8], RZ, !UPT, gsb0
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        EXIT""")) == [(0x10, r) for r in range(104, 108)]
    assert written(found) == [(0x40, 105)]  # in flight on the branch's path
    # a guarded wait may not run: it retires nothing
    assert written(check(f"""
        {PV}
        @P0 WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R104, RZ
        EXIT""")) == [(0x20, 104)]
    # an unconditional branch past the write: never reached in flight
    assert check(f"""
        {PV}
        BRA 0x30
        MOV R104, RZ
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        MOV R104, RZ
        EXIT""").ok


def test_subroutines_are_followed_for_every_caller():
    code = """
        {before}
        CALL.REL.NOINC 0x60
        MOV R104, RZ
        WARPGROUP.DEPBAR.LE gsb0, 0x0
        CALL.REL.NOINC 0x60
        EXIT
        MOV R105, RZ
        RET.REL.NODEC R2 0x0"""
    assert written(check(code.format(before=PV))) == [(0x20, 104), (0x60, 105)]
    assert check(code.format(before="NOP")).ok


def test_shared_memory_a_operands_and_unfollowed_control_flow():
    assert check("""
        IGMMA.64x128x32.S8.S8 R24, gdesc[UR8], RZ, !UPT, gsb0
        MOV R24, RZ
        EXIT""").wgmma == 0
    with pytest.raises(ValueError, match="control flow"):
        check(f"""
            {PV}
            BRX R2 -0x10
            EXIT""")
