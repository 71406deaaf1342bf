"""Every kernel is launched by keyword: a stride in the wrong slot cannot go unnoticed, since each
tensor's strides travel as one named tuple (``x_strides=x.stride()``) or inside its operand."""

from __future__ import annotations

import pytest

from lowbit_attn.core.recipes import RECIPES, get_recipe
from lowbit_attn.tools import aot

MAX_ARGUMENTS = 64  # top-level names, constexprs and num_warps included; a stride tuple is one (the
# quantization launch with its three parts takes 61; a launch plan replays it without binding)


def _launches():
    for name in RECIPES:
        if name == "exact":
            continue
        for causal in (False, True):
            for return_lse in (False, True):
                yield from aot.record_launches(get_recipe(name), head_dim=64, causal=causal,
                                               return_lse=return_lse)
    for mode in ("recompute", "atomic"):
        yield from aot.record_train_launches("sagebwd_int8", head_dim=64, causal=True,
                                             dq_mode=mode)
    yield from aot.record_vsa_launches(head_dim=64)


LAUNCHES = list(_launches())


@pytest.mark.triton_internals
def test_every_kernel_family_is_recorded():
    names = {launch.name for launch in LAUNCHES}
    for kernel in ("_attn_fwd_int8_kernel", "_attn_fwd_fp4_kernel", "_quantize_kernel",
                   "_channel_stats_kernel", "_train_fwd_kernel", "_train_dkdv_kernel",
                   "_train_dq_kernel", "_dq_finish_kernel", "_vsa_fwd_kernel"):
        assert kernel in names


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: launch.name)
def test_launches_pass_keywords_only_and_few_of_them(launch):
    assert launch.args == ()
    assert len(launch.kwargs) <= MAX_ARGUMENTS
    for name, value in launch.kwargs.items():  # strides: a tuple of ints per tensor
        if name.endswith("_strides"):
            assert isinstance(value, tuple) and all(isinstance(s, int) for s in value), name
