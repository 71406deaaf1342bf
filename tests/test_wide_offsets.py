"""Rows of one (batch, head) that span 2^31 elements or more (an NHD tensor with ``H·D = 4096``
at ``N ≥ 524288``, or any strided view): the Triton kernels address them in 64 bits where they
read the user's tensors or write the outputs. Before, the channel statistics of Q, K and V
multiplied a token index by the stride in int32, and the FP4 and training kernels did so in their
output stores: a long NHD prefill read and wrote out of bounds (a crash on the CPU, garbage or an
illegal address on a GPU).

Each case runs on the interpreter in a process of its own (a wrapped offset ends it with a
segmentation fault): a view over storage of 2^31 and more elements that is allocated and never
written but where the view's rows lie, against the same values contiguous, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.interpreter, pytest.mark.slow]

PRELUDE = """
import sys, torch
sys.path.insert(0, {tests!r})
import helpers
g = torch.Generator().manual_seed(0)
def randn(*shape):
    return torch.randn(*shape, generator=g).half()
def wide_like(x):  # the same values, each token 2^24 + 2^20 elements after the previous one
    w = helpers.wide_rows(tuple(x.shape), x.dtype)
    w.copy_(x)
    return w
"""

CASES = {
    "inputs": """
import lowbit_attn
for recipe in ("qk_int8_pv_fp8", "qk_int8_pv_fp16", "qk_fp4_pv_fp4"):
    qkv = [randn(1, 2, 130, 64) for _ in range(3)]
    want = lowbit_attn.attention(*qkv, recipe=recipe, is_causal=True)
    for i in range(3):
        args = list(qkv)
        args[i] = wide_like(args[i])
        got = lowbit_attn.attention(*args, recipe=recipe, is_causal=True)
        assert torch.equal(got, want), (recipe, i)
""",
    "outputs": """
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import op
q, k, v = (randn(1, 2, 130, 64) for _ in range(3))
for recipe in ("qk_fp4_pv_fp4", "qk_int8_pv_fp8"):
    want, got = torch.empty_like(q), helpers.wide_rows(tuple(q.shape), q.dtype)
    for out in (want, got):
        op.run(q, k, v, out=out, recipe=get_recipe(recipe), scale=0.125, causal_offset=None,
               return_lse=False, backend="triton")
    assert torch.equal(got, want), recipe
""",
    "training": """
from lowbit_attn.core.options import KernelOptions
from lowbit_attn.core.recipes import resolve_train
from lowbit_attn.training import op
from lowbit_attn.training.prepare import prepare, prepare_grad
for keep in ((), ("qk", "pv", "dp", "dv", "dq", "dk")):  # INT8 operands, or the 16-bit inputs
    recipe = resolve_train("sagebwd_int8", keep_16bit=keep)
    q, k, v, do = (randn(1, 2, 130, 64) for _ in range(4))
    results = []
    for make in (lambda x: x, wide_like):
        ops = prepare(make(q), make(k), make(v), recipe, 0.125, "triton")
        out = make(torch.zeros_like(q))
        lse = op.kernel_forward(ops, out=out, causal_offset=0)
        grads = [make(torch.zeros_like(x)) for x in (q, k, v)]
        op.kernel_backward(ops, prepare_grad(make(do), recipe, "triton"), lse, *grads,
                           causal_offset=0, softmax_scale=0.125, options=KernelOptions())
        results.append([out, *grads])
    for name, got, want in zip(("out", "dq", "dk", "dv"), results[1], results[0]):
        assert torch.equal(got, want), (keep, name)
""",
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_past_2_31_elements_are_addressed_in_64_bits(case):
    tests = str(Path(__file__).parent)
    script = PRELUDE.format(tests=tests) + textwrap.dedent(CASES[case])
    env = dict(os.environ, TRITON_INTERPRET="1", LOWBIT_ATTN_BACKEND="triton")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-3000:]}"
