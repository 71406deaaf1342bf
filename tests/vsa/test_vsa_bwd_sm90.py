"""Video sparse attention's 16-bit fine backward on the trainable attention's Gluon loops for
Hopper (``training.kernel_bwd_sm90.vsa_backward``: the same dK/dV and dQ kernels over the
block-sparse tile lists), executed on the CPU by ``lowbit_attn.tools.gluon_cpu`` and compared
bit for bit with the tile-order twin ``vsa.naive.fine_backward_tiles`` (itself checked against
autograd of the exact fine stage ``vsa.naive.fine``). Products in float64 rounded once on both
sides (``canonical_reductions``)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bits, one_torch_thread
import helpers
helpers.require_gluon("hopper", "cpu_model")  # before importing Gluon code

from lowbit_attn.core.metrics import errors
from lowbit_attn.training import kernel_bwd_sm90 as k90
from lowbit_attn.tools import gluon_cpu
from lowbit_attn.vsa import kernel_fine, naive as vref
from lowbit_attn.vsa.tiles import tile_layout

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def inputs(grid, hq, hkv, d, topk, dtype=torch.bfloat16, seed=0):
    """Padded tiles (zeros in the empty slots), index lists, counts, the fine forward's output
    and base-2 LSE (the reference's), Δ = rowsum(dO ∘ O), and the tokens in float64."""
    g = torch.Generator().manual_seed(seed)
    layout = tile_layout(grid, (4, 4, 4))
    nt, n = layout.n_tiles, layout.n_tokens
    q, k, v, do = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64)
                   for h in (hq, hkv, hkv, hq))
    idx = torch.randn(1, hq, nt, nt, generator=g).topk(topk, -1).indices.sort(-1).values
    tiles = lambda t: vref.gather_tiles(t.to(dtype), layout, 64).contiguous()  # noqa: E731
    qt, kt, vt, dot = (tiles(t) for t in (q, k, v, do))
    scale = d ** -0.5
    out, lse = _forward(qt, kt, vt, idx, layout, scale)
    delta = (dot.float() * out.float()).sum(-1)
    return dict(qt=qt, kt=kt, vt=vt, dot=dot, lse=lse, delta=delta,
                idx=idx.to(torch.int32).contiguous(), counts=layout.counts.to(torch.int32),
                scale=scale), (q, k, v, do, idx, layout)


def _forward(qt, kt, vt, idx, layout, scale):
    """The fine forward on tiles in float64: ``(out tiles, base-2 LSE [B, Hq, nt, 64])`` (zeros
    and -inf in the empty slots)."""
    b, hq, nt, ts, d = qt.shape
    group = hq // kt.shape[1]
    sel = idx.reshape(b, hq, -1)
    take = lambda t: torch.gather(  # noqa: E731
        t.double().repeat_interleave(group, 1), 2,
        sel[..., None, None].expand(-1, -1, -1, ts, d)).reshape(b, hq, nt, -1, d)
    slots = torch.arange(ts)[None, :] < layout.counts[:, None]
    s = torch.matmul(qt.double(), take(kt).transpose(-1, -2)) * scale
    s = s.masked_fill(~slots[idx].reshape(b, hq, nt, 1, -1), float("-inf"))
    out = torch.matmul(torch.softmax(s, -1), take(vt))
    lse = torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    rows = slots[None, None]
    return torch.where(rows[..., None], out, 0).to(qt.dtype), torch.where(rows, lse,
                                                                           float("-inf")).float()


CASES = [
    pytest.param((4, 8, 8), 2, 1, 64, 3, id="grid4x8x8-GQA2:1-D64-top3"),
    pytest.param((3, 5, 7), 2, 2, 128, 4, id="grid3x5x7-partial-tiles-D128-top4"),
    pytest.param((8, 4, 12), 3, 1, 64, 4, id="grid8x4x12-MQA3:1-D64-top4"),
]


@pytest.mark.parametrize("grid,hq,hkv,d,topk", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_vsa_backward_equals_the_tile_twin_bit_for_bit(grid, hq, hkv, d, topk, dtype):
    kw, _ = inputs(grid, hq, hkv, d, topk, dtype)
    with gluon_cpu.canonical_reductions():
        want = vref.fine_backward_tiles(**kw)
    got = tuple(torch.zeros(t.shape) for t in (kw["qt"], kw["kt"], kw["vt"]))
    with gluon_cpu.kernel_on_cpu(k90, "_dkdv_sm90_kernel"), \
            gluon_cpu.kernel_on_cpu(k90, "_dq_sm90_kernel"):
        reverse = kernel_fine.reverse_lists(kw["idx"], kw["qt"].shape[2])
        k90.vsa_backward(kw["qt"], kw["kt"], kw["vt"], kw["dot"], kw["lse"], kw["delta"],
                         kw["idx"], reverse, kw["counts"], *got, scale=kw["scale"])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_bits(g, w, name)


def test_the_tile_twin_is_the_exact_backward():
    """``fine_backward_tiles`` against autograd of the exact fine stage in float64 (the twin's
    own error: bf16 operands, P and dS rounded to bf16)."""
    kw, (q, k, v, do, idx, layout) = inputs((8, 8, 12), 4, 2, 64, 5)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = vref.fine(qq, kk, vv, layout, idx, scale=kw["scale"])
    exact = torch.autograd.grad(out, (qq, kk, vv), do)
    got = vref.fine_backward_tiles(**kw)
    for name, g, e in zip(("dq", "dk", "dv"), got, exact):
        assert errors(vref.scatter_tiles(g, layout).double(), e).cosine > 0.99998, name


def test_the_launch_path_takes_the_sm90_loops(monkeypatch):
    """``kernel_fine.backward(kernel="sm90")`` (the op's call) runs them (on the model here):
    the twin's tiles, in the inputs' dtype (Δ from the forward's output, as there)."""
    kw, _ = inputs((4, 8, 8), 2, 1, 64, 3)
    args = (kw["qt"], kw["kt"], kw["vt"])
    out, lse = _forward(*args, kw["idx"].long(), tile_layout((4, 8, 8), (4, 4, 4)), kw["scale"])
    with gluon_cpu.kernel_on_cpu(k90, "_dkdv_sm90_kernel") as dkdv, \
            gluon_cpu.kernel_on_cpu(k90, "_dq_sm90_kernel") as dq:
        got = kernel_fine.backward(*args, out, lse, kw["dot"], kw["idx"], kw["counts"],
                                   scale=kw["scale"], kernel="sm90")
    assert dkdv.trace.events["programs"] and dq.trace.events["programs"]
    with gluon_cpu.canonical_reductions():
        want = vref.fine_backward_tiles(*args, kw["dot"], lse, kw["delta"], kw["idx"],
                                        kw["counts"], scale=kw["scale"])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_bits(g.float(), w.to(g.dtype).float(), name)
