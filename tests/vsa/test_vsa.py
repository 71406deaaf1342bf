"""Video sparse attention (PyTorch implementation): the tile layout and token order, the fine stage
against dense attention with the corresponding block mask (forward and gradients, partial edge
tiles), all tiles = exact attention, the coarse stage, gates, the sparsity schedule, bad input; the
fine stage's kernels against it on each target of the ``device`` fixture (tests/conftest.py)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit_attn
from helpers import Bound, assert_close, assert_within
from lowbit_attn import get_recipe
from lowbit_attn.tools import inputs
from lowbit_attn.vsa import interface as vsa, op as vsa_ops
from lowbit_attn.vsa import naive as ref
from lowbit_attn.vsa.tiles import from_tile_order, tile_layout, to_tile_order

GRIDS = [
    pytest.param((3, 5, 6), (2, 2, 4), id="T3H5W6-tile2x2x4"),
    pytest.param((4, 8, 8), (4, 4, 4), id="T4H8W8-whole-tiles"),
    pytest.param((5, 6, 7), (4, 4, 4), id="T5H6W7-partial"),
]


def _qkv(n, *, b=2, hq=4, hkv=2, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    return q, k, v


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


# --- tiles ---------------------------------------------------------------------------------------


@given(t=st.integers(1, 6), h=st.integers(1, 7), w=st.integers(1, 7), tt=st.integers(1, 4),
       th=st.integers(1, 4), tw=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_tile_layout_covers_every_token_once(t, h, w, tt, th, tw):
    layout = tile_layout((t, h, w), (tt, th, tw))
    assert layout.n_tiles == math.ceil(t / tt) * math.ceil(h / th) * math.ceil(w / tw)
    assert int(layout.counts.sum()) == t * h * w
    assert torch.equal(layout.perm.sort().values, torch.arange(t * h * w))
    assert torch.equal(layout.perm[layout.inverse], torch.arange(t * h * w))
    # each token's tile holds its coordinates' tile
    n = torch.arange(t * h * w)
    ti, hi, wi = n // (h * w), (n // w) % h, n % w
    gh, gw = math.ceil(h / th), math.ceil(w / tw)
    assert torch.equal(layout.tile_of, ((ti // tt) * gh + hi // th) * gw + wi // tw)


def test_token_order_round_trip_along_any_dim():
    x = torch.randn(2, 90, 3, 5)
    y = to_tile_order(x, (3, 5, 6), (2, 2, 4), dim=1)
    assert not torch.equal(x, y) and torch.equal(from_tile_order(y, (3, 5, 6), (2, 2, 4), dim=1), x)
    with pytest.raises(ValueError, match="holds 90"):
        to_tile_order(x, (3, 5, 6), (2, 2, 4), dim=2)
    for reorder in (to_tile_order, from_tile_order):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
            reorder(x.tolist(), (3, 5, 6), (2, 2, 4), dim=1)


# --- fine stage = dense attention with the block mask ---------------------------------------------


@pytest.mark.parametrize("grid, tile", GRIDS)
def test_fine_stage_equals_masked_dense_attention(grid, tile):
    n = math.prod(grid)
    q, k, v = _qkv(n, seed=1)
    layout = tile_layout(grid, tile)
    g = torch.Generator().manual_seed(2)
    kk = max(1, layout.n_tiles // 3)
    idx = torch.rand(2, 4, layout.n_tiles, layout.n_tiles, generator=g).argsort(-1)[..., :kk]
    do = torch.randn(q.shape, dtype=torch.float64)
    got = _grads(lambda a, b, c: vsa.fine(a, b, c, video_shape=grid, tile=tile, tile_indices=idx),
                 q, k, v, do)
    mask = ref.block_mask(layout, idx)
    want = _grads(lambda a, b, c: ref.masked_attention(a, b, c, mask, scale=16 ** -0.5), q, k, v, do)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, e, atol=1e-12, rtol=1e-10, name=name)


@pytest.mark.parametrize("grid, tile", GRIDS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_all_tiles_without_gates_is_exact_attention(grid, tile, layout):
    n = math.prod(grid)
    q, k, v = _qkv(n, seed=3)
    do = torch.randn(q.shape, dtype=torch.float64)
    if layout == "NHD":
        q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))

    def ours(a, b, c):
        return lowbit_attn.video_sparse_attention(a, b, c, video_shape=grid, tile=tile, topk=1.0,
                                                  layout=layout)

    def exact(a, b, c):
        a, b, c = (x.transpose(1, 2) if layout == "NHD" else x for x in (a, b, c))
        o = torch.nn.functional.scaled_dot_product_attention(a, b, c, enable_gqa=True)
        return o.transpose(1, 2) if layout == "NHD" else o

    for name, a, e in zip(("out", "dq", "dk", "dv"), _grads(ours, q, k, v, do), _grads(exact, q, k, v, do)):
        assert_close(a, e, atol=1e-12, rtol=1e-10, name=name)


def test_tiled_token_order_gives_the_same_result_permuted():
    grid, tile = (5, 6, 7), (4, 4, 4)
    q, k, v = _qkv(math.prod(grid), seed=4)
    kw = dict(video_shape=grid, tile=tile, topk=3, gate_coarse=torch.tensor(0.5))
    rowmajor = lowbit_attn.video_sparse_attention(q, k, v, **kw)
    tiled = lowbit_attn.video_sparse_attention(*(to_tile_order(x, grid, tile) for x in (q, k, v)),
                                               token_order="tiled", **kw)
    assert_close(from_tile_order(tiled, grid, tile), rowmajor, atol=1e-12, name="out")


# --- coarse stage, gates, edges ----------------------------------------------------------------------


def test_coarse_stage_pools_tiles_and_picks_the_top_scores():
    grid, tile = (3, 5, 6), (2, 2, 4)
    q, k, v = _qkv(math.prod(grid), seed=5)
    out, idx, scores = vsa.coarse(q, k, v, video_shape=grid, tile=tile, topk=4)
    layout = tile_layout(grid, tile)
    t = layout.tile_of
    qp = torch.stack([q[:, :, t == i].mean(dim=2) for i in range(layout.n_tiles)], dim=2)
    kp = torch.stack([k[:, :, t == i].mean(dim=2) for i in range(layout.n_tiles)], dim=2)
    vp = torch.stack([v[:, :, t == i].mean(dim=2) for i in range(layout.n_tiles)], dim=2)
    kp, vp = kp.repeat_interleave(2, dim=1), vp.repeat_interleave(2, dim=1)
    want_scores = qp @ kp.transpose(-1, -2) * 16 ** -0.5
    assert_close(scores, want_scores, atol=1e-12, name="scores")
    assert_close(out, (torch.softmax(want_scores, -1) @ vp)[:, :, t], atol=1e-12, name="out")
    assert idx.shape == (2, 4, layout.n_tiles, 4) and torch.all(idx[..., 1:] > idx[..., :-1])
    chosen = torch.gather(want_scores, -1, idx)
    kth = want_scores.topk(4, dim=-1).values[..., -1:]
    assert torch.all(chosen >= kth)


def test_gates_combine_the_two_stages():
    grid, tile = (4, 4, 6), (2, 4, 4)
    q, k, v = _qkv(math.prod(grid), seed=6)
    gc = torch.rand(2, 4, 96, 1, dtype=torch.float64)
    gf = torch.rand(2, 4, 96, 16, dtype=torch.float64)
    oc, idx, _ = vsa.coarse(q, k, v, video_shape=grid, tile=tile, topk=2)
    of = vsa.fine(q, k, v, video_shape=grid, tile=tile, tile_indices=idx)
    out = lowbit_attn.video_sparse_attention(q, k, v, video_shape=grid, tile=tile, topk=2,
                                             gate_coarse=gc, gate_fine=gf)
    assert_close(out, gc * oc + gf * of, atol=1e-12, name="gated")
    assert_close(lowbit_attn.video_sparse_attention(q, k, v, video_shape=grid, tile=tile, topk=2),
                 of, atol=1e-12, name="no gates")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_edge_tiles_never_give_nan(dtype):
    """A query tile whose only key tile is a 1-token corner, and a 1-token query tile."""
    grid, tile = (5, 5, 5), (4, 4, 4)
    q, k, v = _qkv(125, seed=7, dtype=dtype)
    layout = tile_layout(grid, tile)
    corner = int(layout.counts.argmin())
    assert int(layout.counts[corner]) == 1
    idx = torch.full((2, 4, layout.n_tiles, 1), corner)
    do = torch.randn(q.shape).to(dtype)
    fns = [
        lambda a, b, c: vsa.fine(a, b, c, video_shape=grid, tile=tile, tile_indices=idx),
        lambda a, b, c: lowbit_attn.video_sparse_attention(a, b, c, video_shape=grid, tile=tile,
                                                           topk=1, gate_coarse=torch.tensor(1.0)),
    ]
    for fn in fns:
        for x in _grads(fn, q, k, v, do):
            assert torch.isfinite(x).all()


# --- schedule and bad input ----------------------------------------------------------------------


def test_topk_schedule_goes_from_dense_to_the_target():
    steps = [vsa.topk_schedule(s, n_tiles=64, target=0.125, dense_steps=10, anneal_steps=20)
             for s in range(40)]
    assert steps[:10] == [64] * 10 and steps[30:] == [8] * 10
    assert all(a >= b for a, b in zip(steps, steps[1:])) and 8 < steps[20] < 64
    assert vsa.topk_schedule(5, n_tiles=64, target=4) == 4


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        pytest.param({"video_shape": (3, 5, 5)}, ValueError, "holds 75 tokens but the sequence has 90", id="shape-product"),
        pytest.param({"video_shape": (3, 30)}, TypeError, "three ints", id="shape-2d"),
        pytest.param({"tile": (0, 2, 2)}, ValueError, "positive", id="tile-zero"),
        pytest.param({"tile": (8, 8, 8)}, ValueError, "at most 256", id="tile-too-big"),
        pytest.param({"topk": 0}, ValueError, "between 1 and the number of tiles", id="topk-zero"),
        pytest.param({"topk": 13}, ValueError, "between 1 and the number of tiles", id="topk-too-large"),
        pytest.param({"topk": 1.5}, ValueError, r"fraction must be in \(0, 1\]", id="topk-fraction"),
        pytest.param({"topk": True}, TypeError, "topk must be", id="topk-bool"),
        pytest.param({"gate_coarse": torch.ones(3, 1, 1, 1)}, ValueError, "does not broadcast", id="gate-shape"),
        pytest.param({"recipe": "qk_fp4_pv_fp4"}, ValueError, "must be one of", id="recipe-name"),
        pytest.param({"recipe": get_recipe("qk_fp4_pv_fp4")}, ValueError, "INT8 Q·Kᵀ", id="recipe-fp4"),
        pytest.param({"recipe": get_recipe("qk_int8_pv_fp16")}, ValueError, "per token", id="recipe-per-block"),
        pytest.param({"recipe": 8}, TypeError, "recipe must be", id="recipe-type"),
        pytest.param({"token_order": "hwt"}, ValueError, "token_order", id="token-order"),
    ],
)
def test_bad_arguments(kw, exc, message):
    q, k, v = _qkv(90, dtype=torch.float32)
    args = dict(video_shape=(3, 5, 6), tile=(2, 2, 4), topk=2)
    args.update(kw)
    with pytest.raises(exc, match=message):
        lowbit_attn.video_sparse_attention(q, k, v, **args)


def test_the_8bit_fine_stage_is_for_inference():
    q, k, v = _qkv(90, dtype=torch.float32)
    kw = dict(video_shape=(3, 5, 6), tile=(2, 2, 4), topk=2, recipe="qk_int8_pv_fp8")
    with pytest.raises(ValueError, match="for inference"):
        lowbit_attn.video_sparse_attention(q.requires_grad_(), k, v, **kw)
    with torch.no_grad():
        assert torch.isfinite(lowbit_attn.video_sparse_attention(q, k, v, **kw)).all()


def test_bad_tile_indices():
    q, k, v = _qkv(90, dtype=torch.float32)
    kw = dict(video_shape=(3, 5, 6), tile=(2, 2, 4))
    with pytest.raises(ValueError, match="must not repeat"):
        vsa.fine(q, k, v, tile_indices=torch.zeros(2, 4, 12, 2, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match=r"in \[0, 12\)"):
        vsa.fine(q, k, v, tile_indices=torch.full((2, 4, 12, 1), 12), **kw)
    with pytest.raises(ValueError, match="shape"):
        vsa.fine(q, k, v, tile_indices=torch.zeros(2, 4, 11, 1, dtype=torch.long), **kw)
    with pytest.raises(TypeError, match="int32/int64"):
        vsa.fine(q, k, v, tile_indices=torch.zeros(2, 4, 12, 1), **kw)
    with pytest.raises(ValueError, match="same number of tokens"):
        lowbit_attn.video_sparse_attention(q[:, :, :60], k, v, topk=1, **kw)


# --- the fine stage's Triton kernels (interpreter, and compiled on a GPU) ------------------------

# test_gpu.py's: whole 4×4×4 tiles of 64 tokens (and partial ones at every edge), D of 64 and 128
GPU_FINE_CASES = [
    pytest.param(torch.bfloat16, (5, 14, 15), (4, 4, 4), (8, 4), d,
                 id=f"gpu-bf16-partial-TS64-D{d}", marks=pytest.mark.gpu)
    for d in (64, 128)
]


@pytest.mark.parametrize(
    "dtype, grid, tile, heads, d",
    [
        pytest.param(torch.float16, (3, 5, 6), (2, 2, 4), (2, 1), 16, id="fp16-partial-GQA2"),
        pytest.param(torch.bfloat16, (2, 4, 5), (2, 2, 2), (1, 1), 16, id="bf16-partial-TS8"),
    ] + GPU_FINE_CASES,
)
def test_fine_kernels_match_the_reference(triton_backend, monkeypatch, dtype, grid, tile, heads, d,
                                          device):
    """Forward and gradients of the fine stage on the kernels against the PyTorch twin (fp32) on the
    same tile lists, through the public function (gathers, autograd)."""
    hq, hkv = heads
    n = math.prod(grid)
    q, k, v = (x.to(device.name, dtype)
               for x in _qkv(n, b=1, hq=hq, hkv=hkv, d=d, seed=8, dtype=torch.float32))
    do = torch.randn(q.shape).to(device.name, dtype)
    layout = tile_layout(grid, tile)
    g = torch.Generator().manual_seed(9)
    idx = torch.rand(1, hq, layout.n_tiles, layout.n_tiles, generator=g).argsort(-1)[..., :2]
    idx = idx.to(device.name)
    fn = lambda a, b, c: vsa.fine(a, b, c, video_shape=grid, tile=tile, tile_indices=idx)  # noqa: E731
    got = _grads(fn, q, k, v, do)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want = _grads(fn, *(x.float() for x in (q, k, v, do)))
    bound = device.bound("vsa", Bound(rel_l2=2e-2 if dtype == torch.bfloat16 else 3e-3))
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert_within(a.float(), e, bound, name=name)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_fullgraph_compile_of_the_pytorch_path_matches_eager():
    torch._dynamo.reset()
    q, k, v = _qkv(90, dtype=torch.float32, seed=10)
    do = torch.randn(q.shape)

    def f(a, b, c):
        return lowbit_attn.video_sparse_attention(a * 2, b, c, video_shape=(3, 5, 6), tile=(2, 2, 4),
                                                  topk=3, gate_coarse=torch.tensor(0.5)).sin()

    eager = _grads(f, q, k, v, do)
    compiled = _grads(torch.compile(f, fullgraph=True, backend="aot_eager"), q, k, v, do)
    for e, c in zip(eager, compiled):
        assert_close(c, e, atol=1e-6, name="compiled")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU kernels need g++")
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_inductor_with_dynamic_shapes_where_one_tile_is_kept():
    """A fraction that keeps one key tile: the fine stage's valid-slot mask, indexed by the
    selection and reshaped, was compiled by Inductor with a dynamic length into a wrong index
    (an out-of-bounds error from the generated kernel)."""
    torch._dynamo.reset()

    def f(a, b, c):
        return lowbit_attn.video_sparse_attention(a, b, c, video_shape=(a.shape[2] // 16, 4, 4),
                                                  tile=(2, 4, 4), topk=0.5)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    # scalar C++ (Inductor's vectorized kernels do not compile under ATEN_CPU_CAPABILITY=default)
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        assert_close(compiled(q, k, v), f(q, k, v), atol=1e-5)


# --- the 8-bit fine stage (inference) -------------------------------------------------------------

FAMILIES = ["normal", "channel_bias_k", "outliers", "peaked", "flat", "heavy_tail"]


def _family(name, n, *, hq=2, hkv=1, d=64, dtype=torch.float16):
    return inputs.make(name, seed=0, batch=1, heads_q=hq, heads_kv=hkv, n_q=n, n_k=n, head_dim=d,
                       dtype=dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_fine_stage_accuracy(family):
    """Against exact attention with the block mask (fp64): the bars measured on these inputs
    (N=256, D=64, 2 of 4 tiles; lowest cosines 0.99936 with FP8 P·V, 0.99975 with fp16), and with
    every tile selected the same error as dense 8-bit attention (the same per-token INT8 scores;
    only the key blocks' order differs)."""
    grid, tile = (4, 8, 8), (4, 4, 4)
    q, k, v = (x.float() for x in _family(family, 256))
    layout = tile_layout(grid, tile)
    g = torch.Generator().manual_seed(1)
    idx = torch.rand(1, 2, layout.n_tiles, layout.n_tiles, generator=g).argsort(-1)[..., :2]
    sm = 64 ** -0.5
    want = ref.masked_attention(q.double(), k.double(), v.double(), ref.block_mask(layout, idx), scale=sm)
    for recipe, bar in (("qk_int8_pv_fp8", 0.999), ("qk_int8_pv_fp16", 0.9995)):
        got = vsa.fine(q, k, v, video_shape=grid, tile=tile, tile_indices=idx, recipe=recipe)
        assert lowbit_attn.errors(got.double(), want).cosine > bar, recipe
    every = torch.arange(layout.n_tiles).expand(1, 2, layout.n_tiles, -1)
    exact = ref.masked_attention(q.double(), k.double(), v.double(), ref.block_mask(layout, every), scale=sm)
    sparse = vsa.fine(q, k, v, video_shape=grid, tile=tile, tile_indices=every, recipe="qk_int8_pv_fp8")
    dense = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")
    l1_sparse = lowbit_attn.errors(sparse.double(), exact).rel_l1
    assert l1_sparse < 1.1 * lowbit_attn.errors(dense.double(), exact).rel_l1


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_8bit_fine_stage_propagates_nan(where):
    """A NaN is never hidden: it reaches the outputs of its batch element (K's mean and the Q/K
    balancing factors are per (batch, head), so one NaN spreads over the head), others stay finite."""
    grid, tile = (3, 5, 6), (2, 2, 4)
    q, k, v = _qkv(90, b=2, hq=2, hkv=1, dtype=torch.float32)
    layout = tile_layout(grid, tile)
    idx = torch.tensor([0, 1])[None, None, None].expand(2, 2, layout.n_tiles, 2)
    dict(q=q, k=k, v=v)[where][0, 0, int(layout.index[1, 0])] = float("nan")   # a token of tile 1
    out = vsa.fine(q, k, v, video_shape=grid, tile=tile, tile_indices=idx, recipe="qk_int8_pv_fp8")
    assert torch.isnan(out[0]).any() and torch.isfinite(out[1]).all()


SMALL = ((3, 5, 6), (2, 2, 4), 32)  # video, tile, head dim: partial tiles along every axis


@pytest.mark.parametrize(
    "dtype, recipe, family, heads, size",
    [
        pytest.param(torch.float16, "qk_int8_pv_fp8", "outliers", (2, 1), SMALL, id="fp16-fp8pv-GQA2"),
        pytest.param(torch.bfloat16, "qk_int8_pv_fp8", "channel_bias_k", (1, 1), SMALL, id="bf16-fp8pv"),
        pytest.param(torch.float16, "qk_int8_pv_fp16", "heavy_tail", (2, 2), SMALL, id="fp16-fp16pv"),
        pytest.param(torch.bfloat16, get_recipe("qk_int8_pv_fp8").replace(smooth_v=True), "v_bias",
                     (2, 1), SMALL, id="bf16-fp8pv-smooth-v"),
    ] + [  # test_gpu.py's: tiles of 64 tokens, D of 64 and 128
        pytest.param(torch.bfloat16, "qk_int8_pv_fp8", "channel_bias_k", (8, 4),
                     ((5, 14, 15), (4, 4, 4), d), id=f"gpu-bf16-fp8pv-TS64-D{d}",
                     marks=pytest.mark.gpu)
        for d in (64, 128)
    ],
)
def test_8bit_fine_kernel_matches_the_reference(triton_backend, monkeypatch, dtype, recipe, family,
                                                heads, size, device):
    """The kernel against its twin on the same quantized operands (bit-identical quantization),
    partial edge tiles: equal up to the output's rounding (the interpreter truncates fp32 → bf16,
    one ulp)."""
    device.needs(recipe)
    grid, tile, d = size
    q, k, v = (x.to(device.name) for x in _family(family, math.prod(grid), hq=heads[0],
                                                  hkv=heads[1], d=d, dtype=dtype))
    layout = tile_layout(grid, tile)
    g = torch.Generator().manual_seed(3)
    idx = torch.rand(1, heads[0], layout.n_tiles, layout.n_tiles, generator=g).argsort(-1)[..., :3]
    idx = idx.to(device.name)
    fn = lambda a, b, c: vsa.fine(a, b, c, video_shape=grid, tile=tile, tile_indices=idx,  # noqa: E731
                                  recipe=recipe)
    got = fn(q, k, v)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want = fn(q.float(), k.float(), v.float())
    assert got.dtype == dtype and torch.isfinite(got).all()
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert_within(got.float(), want, device.bound("vsa 8bit", Bound(atol=ulp * 1e-2, rtol=ulp)),
                  name="out")


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_8bit_fine_stage_keeps_tiny_and_huge_v(backend, recipe, monkeypatch):
    """bf16 V of 1e-8 (flushed by plain fp16 rounding) or 1e5 (past 65504): the fine stage scales
    V per channel as the dense forward does, so its error is that of V of order 1."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    grid, tile = (3, 5, 6), (2, 2, 4)
    q, k, v = _qkv(90, b=1, hq=2, hkv=1, d=32, dtype=torch.float32)
    layout = tile_layout(grid, tile)
    idx = torch.tensor([0, 2, 1])[None, None, None].expand(1, 2, layout.n_tiles, 3)
    mask = ref.block_mask(layout, idx)

    def rel_l1(factor):
        qb, kb, vb = q.bfloat16(), k.bfloat16(), (v * factor).bfloat16()
        out = vsa.fine(qb, kb, vb, video_shape=grid, tile=tile, tile_indices=idx, recipe=recipe)
        want = ref.masked_attention(qb.double(), kb.double(), vb.double(), mask, scale=32**-0.5)
        return lowbit_attn.errors(out, want).rel_l1

    base = rel_l1(1.0)
    for factor in (1e-8, 1e5):
        assert rel_l1(factor) < 1.05 * base, factor

@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_8bit_path_compiles_fullgraph():
    torch._dynamo.reset()
    q, k, v = _qkv(90, dtype=torch.float32, seed=12)

    def f(a, b, c):
        return lowbit_attn.video_sparse_attention(a, b, c, video_shape=(3, 5, 6), tile=(2, 2, 4),
                                                  topk=3, recipe="qk_int8_pv_fp8")

    with torch.no_grad():
        eager = f(q, k, v)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager, compiled)


def test_8bit_custom_op_passes_opcheck():
    q, k, v = _qkv(90, b=1, hq=2, hkv=1, dtype=torch.float32, seed=13)
    idx = torch.tensor([0, 3])[None, None, None].expand(1, 2, 12, 2).contiguous()
    key = lowbit_attn.core.recipes.recipe_key(vsa.resolve_recipe("qk_int8_pv_fp8"))
    torch.library.opcheck(vsa_ops.fine_int8, (q, k, v, idx, [3, 5, 6], [2, 2, 4], 0.25, key),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_kernel_path_compiles_fullgraph_with_its_custom_ops(triton_backend):
    """The 16-bit kernels sit behind custom ops: torch.compile traces forward and backward around
    them (graph of the gathers, the ops opaque), same numbers as eager."""
    torch._dynamo.reset()
    q, k, v = (x.half() for x in _qkv(40, b=1, hq=1, hkv=1, seed=14, dtype=torch.float32))
    do = torch.randn(q.shape).half()

    def f(a, b, c):
        return lowbit_attn.video_sparse_attention(a, b, c, video_shape=(2, 4, 5), tile=(2, 2, 2),
                                                  topk=2)

    eager = _grads(f, q, k, v, do)
    compiled = _grads(torch.compile(f, fullgraph=True, backend="aot_eager"), q, k, v, do)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.interpreter
def test_fine_custom_ops_pass_opcheck():
    layout = tile_layout((2, 4, 5), (2, 2, 2))
    q, k, v = (ref.gather_tiles(x.half(), layout, 16).contiguous()
               for x in _qkv(40, b=1, hq=2, hkv=1, seed=15, dtype=torch.float32))
    q.requires_grad_()
    idx = torch.tensor([0, 2], dtype=torch.int32)[None, None, None].expand(1, 2, layout.n_tiles, 2).contiguous()
    torch.library.opcheck(vsa_ops.fine_fwd, (q, k, v, idx, layout.counts.int(), 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# --- tokens ↔ padded tiles, tile means (kernels) ---------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("grid, tile", GRIDS[::2])
def test_tile_kernels_gather_pool_and_are_adjoint(grid, tile):
    from lowbit_attn.vsa import kernel_tiles as vsa_tiles

    layout = tile_layout(grid, tile)
    n, slots = math.prod(grid), 1 << (layout.tile_tokens - 1).bit_length()
    x = torch.randn(2, n, 3, 24).transpose(1, 2)                 # an NHD view, D not a power of 2
    tiles, pooled = vsa_tiles.tile(x, layout.index, layout.counts, slots=slots, pool=True)
    want = ref.gather_tiles(x, layout, slots)
    assert torch.equal(tiles, want)
    torch.testing.assert_close(pooled, ref.pool_tiles(x, layout), rtol=1e-6, atol=1e-6)
    assert vsa_tiles.tile(x, layout.index, layout.counts, slots=0, pool=True)[0] is None
    # untile is the adjoint: <tile(x), (T, P)> = <x, untile(T, P)>; and it undoes tile
    t, p = torch.randn(tiles.shape), torch.randn(pooled.shape)
    back = vsa_tiles.untile(t, p, layout.index, layout.counts, n_tokens=n, dtype=torch.float32)
    lhs = (tiles * t).sum() + (pooled * p).sum()
    torch.testing.assert_close(lhs, (x * back).sum(), rtol=1e-5, atol=1e-4)
    undone = vsa_tiles.untile(tiles, None, layout.index, layout.counts, n_tokens=n, dtype=x.dtype)
    assert torch.equal(undone, x)


@pytest.mark.interpreter
def test_tile_custom_ops_pass_opcheck():
    layout = tile_layout((3, 5, 6), (2, 2, 4))
    x = torch.randn(1, 2, 90, 16, requires_grad=True)
    torch.library.opcheck(vsa_ops.tile, (x, layout.index, layout.counts, 16, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    t = torch.randn(1, 2, layout.n_tiles, 16, 16, requires_grad=True)
    torch.library.opcheck(vsa_ops.untile, (t, None, layout.index, layout.counts, 90, torch.float32),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.interpreter
def test_kernel_path_with_coarse_gate_matches_the_reference(triton_backend, monkeypatch):
    """The whole operator on the kernels (tile means and padded tiles from one pass, the fine
    kernels, the adjoint scatter) against the PyTorch path: forward and gradients with both gates."""
    grid, tile = (3, 5, 6), (2, 2, 4)
    q, k, v = (x.half() for x in _qkv(90, b=1, hq=2, hkv=1, d=16, seed=16, dtype=torch.float32))
    do = torch.randn(q.shape).half()
    gate = torch.rand(1, 2, 90, 1).half()

    def fn(a, b, c):
        return lowbit_attn.video_sparse_attention(a, b, c, video_shape=grid, tile=tile, topk=4,
                                                  gate_coarse=gate.to(a.dtype),
                                                  gate_fine=(1 - gate).to(a.dtype))

    got = _grads(fn, q, k, v, do)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want = _grads(fn, *(x.float() for x in (q, k, v, do)))
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float16 and torch.isfinite(a).all(), name
        assert float((a.float() - e).norm() / e.norm()) < 3e-3, name
