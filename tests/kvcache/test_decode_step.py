"""``DecodeStep``: a decode step that a CUDA graph can replay. Its runs give the eager steps'
bits (append, then ``attention_with_kv_cache``); its launches, replayed as a graph would (the
same launches with the same arguments, new values copied into the same input tensors), give them
too; a replay past the reserved steps gives NaN and the cache refuses its next eager use.

A CUDA graph replays kernels and nothing else. Here the replay is re-issuing the recorded Triton
launches of one run on the interpreter: the host code of ``run`` does not execute again, exactly
as in a graph. (The capture itself needs a GPU: the ``gpu`` test at the end.)
"""

from __future__ import annotations

import re

import pytest
import torch

import lowbit_attn
from lowbit_attn.kvcache import kernel_append, kernel_decode
from lowbit_attn.kvcache import step as step_module

PAGE = 16
HKV, GROUP, D = 2, 4, 64


def prompt_cache(device: str, lengths=(13, 30), max_tokens=64, recipe="kv_int8_fp8",
                 dtype=torch.float16):
    """A cache holding a padded prompt: ``lengths[b]`` tokens in sequence ``b``."""
    g = torch.Generator().manual_seed(0)
    n = max(lengths)
    k = torch.randn(len(lengths), HKV, n, D, generator=g) + 2 * torch.randn(len(lengths), HKV, 1, D,
                                                                              generator=g)
    v = torch.randn(len(lengths), HKV, n, D, generator=g)
    valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    cache = lowbit_attn.QuantizedKVCache(1, len(lengths), HKV, D, max_tokens=max_tokens,
                                         page_size=PAGE, recipe=recipe, dtype=dtype, device=device)
    cache.append(0, k.to(device, dtype), v.to(device, dtype), valid=valid.to(device))
    return cache


def step_inputs(steps: int, batch: int, device: str, tokens: int = 1, dtype=torch.float16):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(batch, h, tokens, D, generator=g).to(device, dtype)
                  for h in (HKV * GROUP, HKV, HKV)) for _ in range(steps)]


def eager_steps(cache, inputs):
    outs = []
    for q, k, v in inputs:
        cache.append(0, k, v)
        outs.append(lowbit_attn.attention_with_kv_cache(q, cache, 0, return_lse=True))
    return outs


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("recipe, dtype", [("kv_int8_fp8", torch.float16),
                                           ("kv_int8_int8", torch.bfloat16)])
def test_runs_give_the_eager_steps_bits(device, monkeypatch, backend, recipe, dtype):
    """Five steps from lengths 13 and 30 (16-token pages: pages open and fill on the way)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    inputs = step_inputs(5, 2, device.name, dtype=dtype)
    want = eager_steps(prompt_cache(device.name, recipe=recipe, dtype=dtype), inputs)
    cache = prompt_cache(device.name, recipe=recipe, dtype=dtype)
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=5)
    for (q, k, v), (out, lse) in zip(inputs, want):
        got = step.run(q, k, v)
        assert got is step.out
        assert torch.equal(got, out) and torch.equal(step.lse, lse)
    assert cache.length(0).tolist() == [18, 35]
    with pytest.raises(ValueError, match="has used the steps this DecodeStep reserved"):
        step.run(*inputs[0])
    assert cache.length(0).tolist() == [18, 35]


class Replayer:
    """Records the launches of the kernels it wraps (and runs them): what a CUDA graph holds."""

    def __init__(self, monkeypatch):
        self.launches = []
        for module, name in ((kernel_append, "_append_kernel"),
                             (kernel_decode, "_decode_split_kernel"),
                             (kernel_decode, "_decode_merge_kernel")):
            monkeypatch.setattr(module, name, self.wrap(getattr(module, name)))

    def wrap(self, kernel):
        launches = self.launches

        class Recording:
            def __getitem__(self, grid):
                def launch(**kwargs):
                    launches.append((kernel, grid, kwargs))
                    return kernel[grid](**kwargs)
                return launch
        return Recording()

    def replay(self):
        for kernel, grid, kwargs in self.launches:
            kernel[grid](**kwargs)


def test_replayed_launches_give_the_eager_steps_bits(device, monkeypatch):
    """One run recorded (as a capture would, after the eager run that compiles), then replayed
    four times with new inputs copied into the recorded ones; the cache reads its lengths back
    before its next eager use."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    inputs = step_inputs(6, 2, device.name)
    want = eager_steps(prompt_cache(device.name), inputs)
    cache = prompt_cache(device.name)
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=6)
    q, k, v = (x.clone() for x in inputs[0])
    assert torch.equal(step.run(q, k, v), want[0][0])
    replayer = Replayer(monkeypatch)
    for x, new in zip((q, k, v), inputs[1]):
        x.copy_(new)
    assert torch.equal(step.run(q, k, v), want[1][0])
    assert [kernel.fn.__name__ for kernel, _, _ in replayer.launches] == [
        "_append_kernel", "_decode_split_kernel", "_decode_merge_kernel"]
    cache.layers[0].host_stale = True  # what run() sets under capture
    for (new_q, new_k, new_v), (out, lse) in zip(inputs[2:], want[2:]):
        for x, new in zip((q, k, v), (new_q, new_k, new_v)):
            x.copy_(new)
        replayer.replay()
        assert torch.equal(step.out, out) and torch.equal(step.lse, lse)
    assert cache.layers[0].host_lengths == [15, 32]  # stale: the replays ran on the device
    assert cache.store(0).host_lengths == [19, 36]  # read back


def test_a_replay_past_the_reserved_pages_gives_nan_and_the_cache_refuses(device, monkeypatch):
    """Lengths 13 and 15 with 16-token pages and one step reserved: the step fills sequence 1's
    page, so a replay's token needs a page it does not hold; sequence 0 still has room on its
    page (a step reserves pages: its replays fail at the first token past them)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    cache = prompt_cache(device.name, lengths=(13, 15))
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=1)
    inputs = step_inputs(3, 2, device.name)
    q, k, v = (x.clone() for x in inputs[0])
    replayer = Replayer(monkeypatch)
    first = step.run(q, k, v).clone()
    assert torch.isfinite(first).all()
    cache.layers[0].host_stale = True
    replayer.replay()  # past the reserved step: sequence 1 has no page for it
    assert torch.isfinite(step.out[0]).all() and torch.isnan(step.out[1]).all()
    assert torch.isnan(step.lse[1]).all()
    assert cache.layers[0].overflow.tolist() == [0, 1]
    assert cache.length(0).tolist() == [15, 16]  # sequence 1 did not advance
    for use in (lambda: cache.append(0, k, v), lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0),
                lambda: lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=1)):
        with pytest.raises(RuntimeError, match=re.escape("found no page for sequences [1]")):
            use()
    cache.reset()
    assert cache.layers[0].overflow.tolist() == [0, 0] and cache.length(0).tolist() == [0, 0]


def test_reserved_pages_are_not_taken_twice(monkeypatch):
    """Pages reserved by a step, then eager appends over them: each page once in the table."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    cache = prompt_cache("cpu", lengths=(13, 30), max_tokens=96)
    lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=20)  # 33 and 50 tokens: 3 and 4 pages
    layer = cache.layers[0]
    assert layer.host_pages == [3, 4]
    taken = sorted(layer.block_table[layer.block_table >= 0].tolist())
    for q, k, v in step_inputs(40, 2, "cpu"):  # 53 and 70 tokens: one page more each
        cache.append(0, k, v)
    assert layer.host_pages == [4, 5]
    table = layer.block_table[layer.block_table >= 0].tolist()
    assert len(table) == len(set(table)) == 9 and set(taken) < set(table)
    assert len(layer.free) == layer.k.shape[0] - 9


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(heads=3), ValueError, "heads (3) must be a multiple of the cache's kv_heads (2)"),
    (dict(steps=0), ValueError, "steps must be at least 1"),
    (dict(tokens=True), TypeError, "tokens must be an int"),
    (dict(steps=40), ValueError, "would pass max_tokens=64 for sequence 1"),
    (dict(layer=1), ValueError, "layer must be in [0, 1)"),
])
def test_a_refused_step_names_its_argument_and_reserves_nothing(kwargs, error, message):
    cache = prompt_cache("cpu")
    before = list(cache.layers[0].host_pages)
    args = dict(layer=0, heads=HKV * GROUP, steps=4) | kwargs
    with pytest.raises(error, match=re.escape(message)):
        lowbit_attn.DecodeStep(cache, args.pop("layer"), **args)
    assert cache.layers[0].host_pages == before


def test_a_step_needs_every_sequence_to_hold_its_prompt():
    cache = prompt_cache("cpu", lengths=(13, 0))
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=2)


def test_a_step_refuses_to_run_after_the_cache_is_reset():
    cache = prompt_cache("cpu")
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=2)
    cache.reset()
    with pytest.raises(ValueError, match="the cache was reset since this DecodeStep was built"):
        step.run(*step_inputs(1, 2, "cpu")[0])
    assert cache.length(0).tolist() == [0, 0]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_several_tokens_per_step_give_the_eager_steps_bits(device, monkeypatch, backend):
    """Three tokens per step (speculative verification): each step's queries attend causally,
    bottom-right, to the tokens stored with them."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    inputs = step_inputs(4, 2, device.name, tokens=3)
    want = eager_steps(prompt_cache(device.name), inputs)
    cache = prompt_cache(device.name)
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=4, tokens=3)
    for (q, k, v), (out, lse) in zip(inputs, want):
        assert torch.equal(step.run(q, k, v), out) and torch.equal(step.lse, lse)
    assert cache.length(0).tolist() == [25, 42]


def test_run_refuses_inputs_of_another_shape():
    cache = prompt_cache("cpu")
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=2)
    q, k, v = step_inputs(1, 2, "cpu")[0]
    for args, name in (((q[:, :4], k, v), "q"), ((q, k.float(), v), "k"), ((q, k, v[..., :32]), "v")):
        with pytest.raises(ValueError, match=f"{name} must be torch.float16 of shape"):
            step.run(*args)
    assert cache.length(0).tolist() == [13, 30]


@pytest.mark.gpu
def test_a_cuda_graph_of_steps_gives_the_eager_steps_bits():
    inputs = step_inputs(6, 2, "cuda")
    want = eager_steps(prompt_cache("cuda"), inputs)
    cache = prompt_cache("cuda")
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=6)
    q, k, v = (x.clone() for x in inputs[0])
    assert torch.equal(step.run(q, k, v), want[0][0])  # eager: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(q, k, v)
    for (new_q, new_k, new_v), (out, _) in zip(inputs[1:], want[1:]):
        for x, new in zip((q, k, v), (new_q, new_k, new_v)):
            x.copy_(new)
        graph.replay()
        assert torch.equal(step.out, out)
    assert cache.store(0).host_lengths == [19, 36]


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89", "sm_120a"])
def test_the_step_kernels_compile_without_spills(monkeypatch, arch):
    """The three launches of a run (the append with its overflow guard, the split kernel with
    ``ADDED``, the merge that advances the lengths), compiled ahead of time: D = 128, 64-token
    pages, GQA 8, an fp16 cache."""
    from helpers import record_launches
    from lowbit_attn.tools import aot

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    appends = record_launches(monkeypatch, kernel_append, ("_append_kernel",))
    reads = record_launches(monkeypatch, kernel_decode,
                            ("_decode_split_kernel", "_decode_merge_kernel"))
    for module in (kernel_append, kernel_decode):
        monkeypatch.setattr(module, "exact_fp8", lambda: False)
    monkeypatch.setattr(kernel_decode, "interpreter_enabled", lambda: False)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 4, 128, max_tokens=1024, page_size=64)
    kv = torch.randn(2, 4, 700, 128).half()
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")  # the prompt, eagerly
    cache.append(0, kv, kv)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    step = lowbit_attn.DecodeStep(cache, 0, heads=32, steps=8)
    step.run(torch.randn(2, 32, 1, 128).half(), kv[:, :, :1], kv[:, :, :1])
    launches = appends + reads
    assert [launch.name for launch in launches] == [
        "_append_kernel", "_decode_split_kernel", "_decode_merge_kernel"]
    assert launches[0].kwargs["ERR"] is not None and launches[2].kwargs["ERR"] is not None
    for launch in launches:
        r = aot.compile_launch(launch, arch)
        assert r.error is None, r.error
        assert r.spill_stores == 0 and r.spill_loads == 0, (r.kernel, r.registers, r.spill_stores)


def test_a_captured_run_is_triton_launches_and_nothing_else(monkeypatch):
    """Under capture, ``run``'s host code issues the three launches and no PyTorch operation at
    all: no allocation, no copy, no read back (each of which a graph would either bake in or
    refuse). Shown with the kernels recorded, not run, under a dispatch mode that sees every
    operation on a tensor and with the tensor methods that read values to the host watched, on a
    CPU cache told that it is being captured."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from helpers import record_launches

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    cache = prompt_cache("cpu")
    step = lowbit_attn.DecodeStep(cache, 0, heads=HKV * GROUP, steps=4)
    q, k, v = step_inputs(1, 2, "cpu")[0]
    appends = record_launches(monkeypatch, kernel_append, ("_append_kernel",))
    reads = record_launches(monkeypatch, kernel_decode,
                            ("_decode_split_kernel", "_decode_merge_kernel"))
    monkeypatch.setattr(step_module, "graph_capturing", lambda device: True)
    seen = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        def read_back(self, *args, _name=name, _real=getattr(torch.Tensor, name), **kwargs):
            seen.append(f"Tensor.{_name}")
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read_back)

    class Operations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Operations():
        out = step.run(q, k, v)
    assert out is step.out
    assert seen == [], seen
    assert [launch.name for launch in appends + reads] == [
        "_append_kernel", "_decode_split_kernel", "_decode_merge_kernel"]
    assert cache.layers[0].host_stale and cache.layers[0].host_lengths == [13, 30]


def test_the_layers_steps_share_one_workspace_and_keep_their_bits(device, monkeypatch):
    """Two layers' steps, run in turn as a model runs its layers: one workspace between them, and
    each layer's outputs the eager steps' bits."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    g = torch.Generator().manual_seed(5)

    def two_layers():
        cache = lowbit_attn.QuantizedKVCache(2, 2, HKV, D, max_tokens=64, page_size=PAGE,
                                             device=device.name)
        for layer in (0, 1):
            kv = torch.randn(2, HKV, 20 + layer, D, generator=torch.Generator().manual_seed(layer))
            cache.append(layer, *(kv.half().to(device.name),) * 2)
        return cache

    inputs = [[tuple(torch.randn(2, h, 1, D, generator=g).half().to(device.name)
                     for h in (HKV * GROUP, HKV, HKV)) for _ in (0, 1)] for _ in range(3)]
    eager = two_layers()
    want = []
    for step_inputs_ in inputs:
        for layer, (q, k, v) in enumerate(step_inputs_):
            eager.append(layer, k, v)
            want.append(lowbit_attn.attention_with_kv_cache(q, eager, layer))
    cache = two_layers()
    steps = [lowbit_attn.DecodeStep(cache, layer, heads=HKV * GROUP, steps=3) for layer in (0, 1)]
    assert steps[0].buffers.wacc.data_ptr() == steps[1].buffers.wacc.data_ptr()
    got = [steps[layer].run(q, k, v).clone() for step_inputs_ in inputs
           for layer, (q, k, v) in enumerate(step_inputs_)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
