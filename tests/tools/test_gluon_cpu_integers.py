"""``lowbit_attn.tools.gluon_cpu``'s integer arithmetic on a toy Gluon kernel written here: Triton's
types (a kernel's integer arguments int32, or int64 past 2^31; a constant takes the other
operand's type; two values the wider one) and ``Overflow`` where an int32 sum or product does not
hold its exact value, as the GPU would wrap it."""

from __future__ import annotations

import pytest
import torch
from helpers import require_gluon
require_gluon("cpu_model")  # before importing Gluon code

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from lowbit_attn.tools import gluon_cpu

ROWS = gl.constexpr(4)


@gluon.jit
def _copy_rows(X, Y, sxn, syn, WIDE: gl.constexpr):
    """Row ``r`` of ``X`` (a column of ROWS values at stride ``sxn``) to row ``r`` of ``Y``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=layout)
    if WIDE:
        rows = rows.to(gl.int64)
    gl.store(Y + rows * syn, gl.load(X + rows * sxn))


def run(x, y, sxn, syn, wide):
    gluon_cpu.CpuKernel(_copy_rows)[(x.numel() // ROWS.value,)](X=x, Y=y, sxn=sxn, syn=syn,
                                                                 WIDE=wide, num_warps=1)


def test_an_int32_row_offset_that_overflows_is_caught():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty(8)
    with pytest.raises(gluon_cpu.Overflow, match=r"int32 overflow at index \(2,\): 2 \* "
                                                 r"1073741824 = 2147483648"):
        run(x, y, 1, 2**30, wide=False)  # rows 2 on: 2·2^30 = 2^31


def test_an_int64_row_offset_is_exact():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty(8)
    with pytest.raises(gluon_cpu.ScheduleError, match="access outside Y: offset 1073741824 of 8"):
        run(x, y, 1, 2**30, wide=True)  # computed exactly, outside the 8 elements of y
    run(x, y, 1, 1, wide=False)
    assert torch.equal(y, x)


def triton_type(a, b):
    """What ``gluon_cpu`` makes of ``a * b`` (the model's semantics, without a kernel)."""
    with gluon_cpu._Integers():
        return (a * b).dtype


def test_types_follow_triton():
    i32 = torch.arange(4, dtype=torch.int32)
    assert triton_type(i32, 3) == torch.int32  # a constant takes the value's type
    assert triton_type(i32, torch.tensor(3, dtype=torch.int64)) == torch.int64  # torch: int32
    assert triton_type(torch.tensor(3, dtype=torch.int32), i32) == torch.int32
    assert gluon_cpu._kernel_scalar(2**31 - 1).dtype == torch.int32
    assert gluon_cpu._kernel_scalar(2**31).dtype == torch.int64
    assert gluon_cpu._kernel_scalar(1) == 1  # specialized into a constant


def test_int32_sums_and_differences_are_checked_too():
    big = torch.tensor([2**31 - 1], dtype=torch.int32)
    with gluon_cpu._Integers():
        with pytest.raises(gluon_cpu.Overflow):
            big + 1
        with pytest.raises(gluon_cpu.Overflow):
            -big - 2
        assert int(big.to(torch.int64) + 1) == 2**31
