"""torch.compile and torch.library: the public functions trace as one custom op (reference path)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import lowbit_attn
from helpers import channel_biased
from lowbit_attn.core.recipes import recipe_from_key, recipe_key
from lowbit_attn.inference import op as ops


class Block(torch.nn.Module):
    def forward(self, q, k, v):
        a = lowbit_attn.attention(q, k, v, is_causal=True, recipe="qk_int8_pv_fp8")
        b = lowbit_attn.scaled_dot_product_attention(q, k, v)
        c = lowbit_attn.attention(q, k, v, recipe="qk_fp4_pv_fp4")
        o, lse = lowbit_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       layout="NHD", return_lse=True)
        return a + b + c + o.transpose(1, 2), lse


def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    q, k, v = channel_biased((1, 2, 40, 32), (1, 2, 56, 32), seed=2)
    with torch.no_grad():
        eager = Block()(q, k, v)
        compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")(q, k, v)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


class Traced(torch.nn.Module):
    """Arguments computed from sizes, which ``dynamic=True`` traces as symbols."""

    def forward(self, q, k, v):
        n = q.shape[2]
        a = lowbit_attn.attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=n > 1,
                                  chunk=n // 3, softcap=n / 4, window=(n // 2, 0))
        b = lowbit_attn.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)
        c = lowbit_attn.trainable_attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=n > 1)
        return a + b + c


def test_arguments_traced_as_symbols_compile_fullgraph():
    """``scale``, ``is_causal``, ``chunk``, ``softcap`` and ``window`` computed from sizes under
    ``dynamic=True``: one graph, eager's values (the checks read them with ``math.isfinite``,
    ``isinstance`` and a plan key's class tests: graph breaks, so fullgraph failed)."""
    torch._dynamo.reset()
    q, k, v = channel_biased((1, 2, 24, 32), (1, 2, 24, 32), seed=3)
    with torch.no_grad():
        eager = Traced()(q, k, v)
        compiled = torch.compile(Traced(), fullgraph=True, dynamic=True, backend="aot_eager")
        assert torch.equal(compiled(q, k, v), eager)


def test_a_fallback_compiles_fullgraph():
    """A masked call of the SDPA drop-in, and of the patched function, falls back to PyTorch
    inside one graph (the fallback's warning took a lock: a graph break on every fallback)."""
    torch._dynamo.reset()
    q, k, v = channel_biased((1, 2, 16, 32), (1, 2, 16, 32), seed=4)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    drop_in = torch.compile(lambda *a: lowbit_attn.scaled_dot_product_attention(*a, attn_mask=mask),
                            fullgraph=True, backend="aot_eager")
    with pytest.warns(UserWarning, match="attn_mask"):  # eager warns; the traced call does not
        lowbit_attn.integrations.sdpa.reset_fallback_warnings()
        lowbit_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(drop_in(q, k, v), want)
    with lowbit_attn.patch_sdpa():
        patched = torch.compile(
            lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, attn_mask=mask),
            fullgraph=True, backend="aot_eager")
        assert torch.equal(patched(q, k, v), want)


@pytest.mark.parametrize("nhd", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_custom_op_passes_opcheck(nhd, return_lse):
    q, k, v = channel_biased((1, 4, 20, 16), (1, 2, 24, 16), seed=1)
    if nhd:
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    r = lowbit_attn.get_recipe("qk_int8_pv_fp16")
    args = (q, k, v, recipe_key(r), 0.25, True, 4, nhd, return_lse)
    torch.library.opcheck(ops.attention_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_inputs_that_require_grad_are_refused():
    q, k, v = channel_biased((1, 2, 16, 16), (1, 2, 16, 16), seed=0)
    q.requires_grad_()
    with pytest.raises(ValueError, match="must not require grad"):
        lowbit_attn.attention(q, k, v)
    with torch.no_grad():
        assert lowbit_attn.attention(q, k, v).shape == q.shape


def _packed(seed=3):
    lens = [5, 17, 0, 30]
    q, k, v = channel_biased((1, 4, sum(lens), 32), (1, 2, sum(lens), 32), seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(),
            v[0].transpose(0, 1).contiguous(), cu, max(lens))


def test_varlen_compiles_fullgraph_without_the_host_check():
    """With check_seqlens=False nothing reads the offsets outside the op: no graph break (and no
    GPU synchronisation)."""
    torch._dynamo.reset()
    q, k, v, cu, longest = _packed()

    def f(a, b, c):
        out, lse = lowbit_attn.attention_varlen(a, b, c, cu, cu, longest, longest, is_causal=True,
                                                recipe="qk_int8_pv_fp8", return_lse=True,
                                                check_seqlens=False)
        return out.sin(), lse

    with torch.no_grad():
        eager = f(q, k, v)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_varlen_custom_op_passes_opcheck():
    q, k, v, cu, longest = _packed(4)
    r = lowbit_attn.get_recipe("qk_int8_pv_fp16")
    args = (q, k, v, cu, cu, longest, longest, recipe_key(r), 0.25, True, True)
    torch.library.opcheck(ops.attention_varlen_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def _recipes_with_every_option():
    """Every named recipe, and each with every bool flipped and every block size changed where
    the recipe allows it."""
    out = []
    for r in lowbit_attn.RECIPES.values():
        out.append(r)
        for f in dataclasses.fields(r):
            value = getattr(r, f.name)
            others = ([not value] if isinstance(value, bool)
                      else [b for b in (16, 32, 64, 128) if b != value] if isinstance(value, int)
                      else ["per_token"] if f.name == "granularity" else ["custom_name"])
            for other in others:
                try:
                    out.append(r.replace(**{f.name: other}))
                except (ValueError, TypeError):
                    pass  # an option this recipe refuses (e.g. FP4 with balance_qk)
    return out


def test_recipe_key_round_trips_every_recipe_and_option():
    recipes = _recipes_with_every_option()
    assert len(recipes) > 60
    for r in recipes:
        assert recipe_from_key(recipe_key(r)) == r
    # a numpy bool is stored as a bool, so it encodes as the bool does
    r = lowbit_attn.get_recipe("qk_int8_pv_fp16")
    assert recipe_key(r.replace(balance_qk=np.False_)) == recipe_key(r.replace(balance_qk=False))


@pytest.mark.parametrize("edit", [
    pytest.param(lambda key: key.replace("balance_qk=True", "balance_qk=1"), id="bool-as-1"),
    pytest.param(lambda key: key.replace("smooth_v=False", "smooth_v=false"), id="bool-lowercase"),
    pytest.param(lambda key: key.replace("block_q=128", "block_q=0128"), id="int-leading-zero"),
    pytest.param(lambda key: key.replace("block_q=128", "block_q=128.0"), id="int-as-float"),
    pytest.param(lambda key: key.replace(";block_k=64", ""), id="missing-field"),
    pytest.param(lambda key: key + ";extra=1", id="unknown-field"),
    pytest.param(lambda key: key + ";block_k=64", id="repeated-field"),
    pytest.param(lambda key: key.replace("name=qk_int8_pv_fp16", "name=a b"), id="bad-name"),
    pytest.param(lambda key: ";".join(reversed(key.split(";"))), id="order"),
])
def test_recipe_from_key_refuses_any_other_text(edit):
    key = recipe_key(lowbit_attn.get_recipe("qk_int8_pv_fp16"))
    with pytest.raises(ValueError, match="recipe key|Recipe.name"):
        recipe_from_key(edit(key))


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiled_ops_take_strided_views():
    """HND views of NHD storage (what transformers hands its attention functions): the fake
    implementations must give the strides the ops return, or the compiled graph misreads them."""
    torch._dynamo.reset()
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in channel_biased((1, 4, 64, 32), (1, 2, 64, 32), seed=5))
    do = torch.randn(q.shape)

    def f(a, b, c):
        x = lowbit_attn.attention(a, b, c, is_causal=True, recipe="qk_int8_pv_fp8")
        y = lowbit_attn.video_sparse_attention(a.detach(), b.detach(), c.detach(),
                                               video_shape=(4, 4, 4), topk=0.5,
                                               recipe="qk_int8_pv_fp8")
        return (x + y).transpose(1, 2).reshape(1, 64, -1)

    def g(a, b, c):
        return lowbit_attn.trainable_attention(a, b, c, is_causal=True).transpose(1, 2).reshape(1, 64, -1)

    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dy = do.transpose(1, 2).reshape(1, 64, -1)
    eager = torch.autograd.grad(g(*leaves), leaves, dy)
    compiled = torch.autograd.grad(torch.compile(g, fullgraph=True, backend="aot_eager")(*leaves),
                                   leaves, dy)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


class CausalFromShape(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)


def test_patched_sdpa_exports_with_a_symbolic_flag():
    """Under non-strict ``torch.export`` with a dynamic length, ``is_causal=q.shape[2] > 1`` is a
    ``torch.SymBool``: the drop-in takes it as the bool it stands for (the kernels' op is
    exported) instead of handing it to PyTorch's SDPA, which refuses a SymBool."""
    q, k, v = channel_biased((1, 2, 40, 32), (1, 2, 40, 32), seed=3)
    n = torch.export.Dim("n", min=2, max=128)
    with lowbit_attn.patch_sdpa(), torch.no_grad():
        program = torch.export.export(CausalFromShape(), (q, k, v), strict=False,
                                      dynamic_shapes=({2: n}, {2: n}, {2: n}))
    assert "torch.ops.lowbit_attn.attention_fwd" in program.graph_module.code
    q, k, v = channel_biased((1, 2, 56, 32), (1, 2, 56, 32), seed=4)
    got = program.module()(q, k, v)
    want = lowbit_attn.attention(q, k, v, is_causal=True)
    assert torch.equal(got, want)


def test_compiling_the_public_calls_warns_nothing():
    """Dynamo warned once per process where it met the package's ``functools`` caches
    (``triton_installed`` on every call, the VSA tile layout); and a fullgraph trace broke on
    the negation-bit check of the inputs."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 64, 32, requires_grad=True)

    def step(q):
        out = lowbit_attn.trainable_attention(q, q, q, is_causal=True)
        out = out + lowbit_attn.attention(q.detach(), q.detach(), q.detach())
        return out + lowbit_attn.video_sparse_attention(q, q, q, video_shape=(4, 4, 4), topk=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q)
        got.sum().backward()
    assert not [str(w.message) for w in caught if "lowbit_attn" in str(w.message)
                or "lru_cache" in str(w.message)]
    torch.testing.assert_close(got, step(q))


def test_a_compiled_training_step_does_not_recompile_on_the_environment(monkeypatch):
    """The forward's check of the placement variables was traced: Dynamo guarded the graph on
    its memo and on the size of the whole environment (a recompile on the second call and after
    any variable was set)."""
    torch._dynamo.reset()
    step = torch.compile(lambda q: lowbit_attn.trainable_attention(q, q, q).sum(),
                         backend="aot_eager")
    step(torch.randn(1, 2, 64, 32, requires_grad=True)).backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(torch.randn(1, 2, 64, 32, requires_grad=True)).backward()
        monkeypatch.setenv("LOWBIT_ATTN_UNRELATED", "1")
        step(torch.randn(1, 2, 64, 32, requires_grad=True)).backward()
