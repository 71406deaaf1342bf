"""The Gluon Hopper forward (``inference/kernel_int8_gluon.py``) executed on the CPU by
``lowbit_attn.tools.gluon_cpu``: the kernel's own code, launched by its own launcher, with shared
memory, TMA, mbarriers and wgmma modelled, its three partitions (the loader, two consumers) as
cooperatively scheduled threads interleaved by each of the model's policies ("lazy", "eager",
"reverse"), against the twin ``inference.naive.quantized_attention`` bit for bit.

Both sides take fp32 products and row sums in float64 rounded once (``canonical_reductions``), and
the model's ``fma`` rounds twice as the twin's ``s - m`` does; everything else (masks, offsets,
key-block order, the delayed ``acc·α + pv``, E4M3 rounding, the epilogue and LSE) is compared
exactly. ``test_the_check_catches`` breaks the kernel's source in known ways and expects each
break to be caught."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from helpers import (Bound, assert_bits, assert_caught, assert_within, mutant, mutation_params,
                     one_torch_thread,
                     schedule_outcome)
from helpers import causal_offset_of as offset_of
from lowbit_attn.core.recipes import get_recipe
import helpers
helpers.require_gluon("hopper", "cpu_model")  # before importing Gluon code

from lowbit_attn.inference import gluon_blocks as gb
from lowbit_attn.inference import kernel_int8_gluon as kg
from lowbit_attn.inference.naive import quantized_attention
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.tools import gluon_cpu

KERNEL = kg._attn_fwd_int8_pingpong_kernel


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

# (B, Hq, Hkv, Nq, Nk, D, causal offset or None for "nk - nq" when causal): partial query and key
# blocks, GQA and MQA, decode, rows that see no key (a whole query tile with none), offsets past
# the bottom-right diagonal, and enough key blocks to reuse each stage twice.
SHAPES = [
    pytest.param(1, 2, 2, 130, 130, 64, None, id="B1-H2-N130-D64"),
    pytest.param(2, 4, 2, 77, 200, 64, None, id="B2-GQA4:2-Nq77-Nk200-D64"),
    pytest.param(1, 3, 1, 200, 90, 128, None, id="B1-MQA3:1-Nq200-Nk90-D128"),
    pytest.param(1, 1, 1, 1, 257, 128, None, id="B1-decode-Nq1-Nk257-D128"),
    pytest.param(1, 2, 1, 300, 333, 64, None, id="B1-GQA2:1-Nq300-Nk333-D64"),
    pytest.param(1, 1, 1, 300, 40, 64, None, id="B1-Nq300-Nk40-D64-keyless-tiles"),
    pytest.param(1, 2, 2, 150, 100, 128, 0, id="B1-Nq150-Nk100-D128-offset0"),
    pytest.param(1, 1, 1, 200, 300, 64, 150, id="B1-Nq200-Nk300-D64-offset150"),
]


def token_contiguous(v: torch.Tensor) -> torch.Tensor:
    """E4M3 V ``[B, H, N, D]`` as the Gluon kernel takes it: a transposed view of ``[B, H, D, N']``
    (N' a multiple of 16, TMA's stride alignment), the padding poisoned (NaN E4M3)."""
    b, h, n, d = v.shape
    store = torch.full((b, h, d, -(-n // 16) * 16), 0x7F, dtype=torch.uint8)
    store = store.view(torch.float8_e4m3fn)
    store[..., :n] = v.transpose(-1, -2)
    return store.transpose(-1, -2)[:, :, :n]


def operands(b, hq, hkv, nq, nk, d, block_k):
    g = torch.Generator().manual_seed(nq + 7 * nk + d)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + 4 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    recipe = get_recipe("qk_int8_pv_fp8").replace(block_k=block_k)
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    return dataclasses.replace(qz, v=token_contiguous(qz.v))


def twin(qz, block_k, causal_offset, granularity="per_token"):
    with gluon_cpu.canonical_reductions():
        return quantized_attention(qz, pv="fp8", granularity=granularity, block_q=kg.BLOCK_M,
                                   block_k=block_k, causal_offset=causal_offset)


# How the model interleaves the partitions (tools/gluon_cpu.py: "lazy", "eager", "reverse").
POLICIES = list(gluon_cpu.SCHEDULES)


def on_cpu(policy: str = "lazy", **options):
    """The Gluon kernel replaced by the model, its partitions interleaved by ``policy``, for the
    block; yields the model's kernel."""
    return gluon_cpu.kernel_on_cpu(kg, "_attn_fwd_int8_pingpong_kernel", schedule=policy,
                                   **options)


def gluon_on_cpu(qz, block_k, causal_offset, policy="lazy", out=None, **options):
    """``kernel_int8_gluon.attention`` (launcher and kernel) with the kernel run by the model:
    ``(out, lse, trace)``."""
    if out is None:
        out = torch.empty(qz.q.shape, dtype=torch.float32)  # NaN-poisoned (conftest)
    with on_cpu(policy, **options) as cpu:
        lse = kg.attention(qz, out=out, pv="fp8", granularity="per_token", block_q=kg.BLOCK_M,
                           block_k=block_k, causal_offset=causal_offset, return_lse=True)
    return out, lse, cpu.trace


def test_output_rows_past_2_31_elements():
    """An output view whose rows 121 on start past 2^31 elements (``helpers.wide_rows``): its
    row offsets must be computed in 64 bits (the model raises ``gluon_cpu.Overflow`` on an int32
    one), and the rows land where the view says."""
    qz = operands(1, 2, 2, 130, 130, 64, 128)
    want, want_lse = twin(qz, 128, None)
    out = helpers.wide_rows((1, 2, 130, 64), torch.float16)
    _, lse, _ = gluon_on_cpu(qz, 128, None, out=out)
    assert_bits(out.float(), want.half().float(), "out")
    assert_bits(lse, want_lse, "lse")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", SHAPES)
@pytest.mark.parametrize("block_k", kg.BLOCK_NS, ids=lambda n: f"k{n}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gluon_schedule_equals_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, block_k, causal,
                                                    policy):
    qz = operands(b, hq, hkv, nq, nk, d, block_k)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(qz, block_k, co)
    got, got_lse, _ = gluon_on_cpu(qz, block_k, co, policy)
    assert_bits(got, want, "out")
    assert_bits(got_lse, want_lse, "lse")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", SHAPES[:5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_fma_stays_within_the_triton_kernels_bound(b, hq, hkv, nq, nk, d, offset, causal):
    """With the GPU's fused ``fma`` (one rounding) the exp2 argument moves by an ulp now and then:
    the same bound as the Triton kernel against the twin (test_attention_kernel.py)."""
    qz = operands(b, hq, hkv, nq, nk, d, 64)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(qz, 64, co)
    got, got_lse, _ = gluon_on_cpu(qz, 64, co, numerics=gluon_cpu.Numerics(fused_fma=True))
    assert_within(got, want, Bound(atol=4e-3, cos=0.999999), name="out")
    assert_within(got_lse, want_lse, Bound(atol=1e-5, rtol=1e-5), name="lse")


def test_the_shapes_cover_the_schedule():
    """Over three of the shapes above, every branch of the schedule runs: both loops in both mask
    modes, each stage's barrier in both phases, zero fill past the end."""
    events, calls = {}, set()
    for i in (3, 4, 5):  # decode, GQA with 3 query tiles, keyless tiles
        b, hq, hkv, nq, nk, d, offset = SHAPES[i].values
        for block_k in kg.BLOCK_NS:
            for causal in (False, True):
                qz = operands(b, hq, hkv, nq, nk, d, block_k)
                *_, trace = gluon_on_cpu(qz, block_k, offset_of(nq, nk, causal, offset))
                for k, n in trace.events.items():
                    events[k] = events.get(k, 0) + n
                calls |= {(name, dict(flags).get("MASKED"), dict(flags).get("IS_CAUSAL"))
                          for name, flags in trace.calls}
    for masked in (False, True):
        for causal in (False, True):
            assert ("_consumer_step", masked, causal) in calls, (masked, causal)
    assert events["wait phase 0"] and events["wait phase 1"], events
    assert events["tma zero-filled elements"], events


def test_every_gluon_name_the_kernel_uses_is_modelled():
    """A kernel edited to use more of Gluon (another barrier, another operation, …) fails here,
    by name, until the model implements it: the check runs the kernel's code, so what it does
    not model it cannot vouch for."""
    used, modeled = gluon_cpu.referenced_names(KERNEL), gluon_cpu.modeled_names()
    missing = {ns: sorted(names - modeled[ns]) for ns, names in used.items() if names - modeled[ns]}
    assert not missing, f"used by the kernel, not modelled by tools/gluon_cpu.py: {missing}"
    assert {"warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared"} <= used["functions"]
    assert "warp_specialize" in used["gl"] and {"arrive", "wait", "expect"} <= used["mbarrier"]
    assert {"async_copy_global_to_shared", "async_load"} & used["tma"]  # the TMA load, by Triton


# (id, function, old, new, what must happen: "hang", "race", "error" (another ScheduleError),
# "wrong" numbers, or "any" of these), each run under the model's three interleavings: the shared
# numerics and indexing (gluon_blocks), the kernel's loops, stages and loads, then its own
# protocol (loader, two consumers, turns). (Releasing K(j) before Q·Kᵀ(j) retires is not among them: it is harmless here, and the
# model's happens-before check agrees: the loader requests K(j+2) only after V(j+1), whose stage
# the consumers release after the wait that retires Q·Kᵀ(j) too.)
MUTATIONS = [
    ("causal-limit-off-by-one", gb.softmax_block, "nk - 1) - causal_offset", "nk) - causal_offset",
     "wrong"),
    ("end-mask-off-by-one", gb.softmax_block, "cols < nk, offs_m", "cols <= nk, offs_m", "wrong"),
    ("GQA-head-h%GROUP", gb.program_sequence, "hk = h // GROUP", "hk = h % GROUP", "error"),
    ("unmasked-loop-one-too-far", kg._consumer, "range(1, n_full)", "range(1, n_full + 1)", "any"),
    ("last-P-V-other-stage", kg._consumer, "p_smem.index(2 * WG + last % 2)",
     "p_smem.index(2 * WG + (last + 1) % 2)", "any"),
    ("V-coordinate-one-block-late", kg._loader, "v_box(j, v_col", "v_box(j + 1, v_col", "wrong"),
    ("Q-box-at-BLOCK_N-rows", kg._loader, "[pid_m * BLOCK_M + i * HALF, 0]",
     "[pid_m * BLOCK_N + i * HALF, 0]", "wrong"),
    ("K-phase-j&1", kg._consumer_step, "phase = (j // 2) & 1", "phase = j & 1", "race"),
    ("P-into-buffer-in-flight", kg._consumer_step, "p_smem.index(2 * WG + stage).store(p)",
     "p_smem.index(2 * WG + prev).store(p)", "race"),
    ("no-fence-before-wgmma", kg._consumer_step, "store(p)\n    fence_async_shared()\n",
     "store(p)\n", "race"),
    ("wait(2)-for-QK", kg._consumer_step, "warpgroup_mma_wait(1, deps=[s_tok])",
     "warpgroup_mma_wait(2, deps=[s_tok])", "race"),
    ("turn-never-passed", kg._turn_pass, "count=1)", "count=1, pred=False)", "hang"),
    ("K-stage-released-by-one-consumer", KERNEL, "init(k_empty.index(i), count=2)",
     "init(k_empty.index(i), count=1)", "any"),
    ("loader-ignores-K-release", kg._loader, "wait(k_empty.index(stage), phase ^ 1)",
     "wait(k_empty.index(stage), phase ^ 1, pred=False)", "any"),
    ("V-released-before-P̃·V-retires", kg._consumer_step,
     "pv = warpgroup_mma_wait(0, deps=[pv_tok])\n    mbarrier.arrive(v_empty.index(prev), count=1)",
     "mbarrier.arrive(v_empty.index(prev), count=1)\n    pv = warpgroup_mma_wait(0, deps=[pv_tok])",
     "race"),
    ("loader-ignores-V-release", kg._loader, "wait(v_empty.index(stage), phase ^ 1)",
     "wait(v_empty.index(stage), phase ^ 1, pred=False)", "race"),
    ("consumers-share-P̃-buffers", kg._consumer_step, "p_smem.index(2 * WG + stage).store(p)",
     "p_smem.index(stage).store(p)", "race"),
    ("both-consumers-on-rows-0-63", kg._consumer, "row0 = pid_m * BLOCK_M + WG * HALF",
     "row0 = pid_m * BLOCK_M", "race"),  # each output element stored twice
    ("V-phase-of-K", kg._consumer_step, "v_ready.index(prev), phase ^ prev)",
     "v_ready.index(prev), phase)", "race"),
]
MUTATION_CASES = [  # (shape, block_k, causal offset)
    ((1, 2, 1, 300, 333, 64), 64, 33),
    ((2, 4, 2, 77, 200, 64), 64, None),
    ((1, 2, 2, 150, 100, 128), 128, 0),
]


def outcome(jit, old, new) -> str:
    """How the check answers the mutated kernel over ``MUTATION_CASES``, each run under each of
    the model's interleavings: the first failure's kind, or "passes"."""
    def each():
        for (shape, block_k, co), policy in itertools.product(MUTATION_CASES, POLICIES):
            qz = operands(*shape, block_k)
            want, want_lse = twin(qz, block_k, co)
            broken = {jit.fn: mutant(jit, old, new)}
            got, got_lse, _ = gluon_on_cpu(qz, block_k, co, policy, overrides=broken)
            yield [(got, want), (got_lse, want_lse)]

    return schedule_outcome(each())


@pytest.mark.parametrize("jit,old,new,expected", mutation_params(MUTATIONS))
def test_the_check_catches(jit, old, new, expected):
    assert_caught(outcome(jit, old, new), expected)


def test_the_unmutated_kernel_passes_the_mutation_cases():
    assert outcome(kg._consumer, "WG * HALF", "WG * HALF") == "passes"


# Packed variable-length sequences: (query lengths, key lengths, Hq, Hkv, D). Lengths of 1, of a
# partial tile, of several tiles, a sequence with queries and no key, one with keys and no query;
# starts that are not 16-aligned (V's descriptor base moves back to the boundary).
VARLEN = [
    pytest.param([1, 130, 77, 5], [1, 140, 200, 19], 2, 2, 64, id="lens1-130-77-5-D64"),
    pytest.param([3, 0, 200, 4], [9, 33, 90, 0], 4, 2, 128, id="GQA4:2-empty-D128"),
]


def packed_operands(lens_q, lens_k, hq, hkv, d, block_k, granularity="per_token"):
    """Each sequence quantized alone (dense ``[1, H, n, D]``) and the results packed as the
    quantization pass packs them (V token-contiguous ``[H, D, T']``, each sequence from
    ``packed_v_starts``, zeros to the next 16 keys, the rest poisoned): the
    twin of sequence ``i`` is the twin of its own operands. ``(packed QuantizedQKV, Seqs of Q, Seqs
    of K, [per-sequence dense QuantizedQKV or None])``."""
    from lowbit_attn.core.operands import Seqs, packed_v_starts, packed_v_tokens
    alone, parts = [], {n: [] for n in ("q", "qs", "k", "ks", "v", "vs", "lsh")}
    per_token = granularity == "per_token"
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        g = torch.Generator().manual_seed(100 * i + nq + 7 * nk + d)
        if nq and nk:
            q = torch.randn(1, hq, nq, d, generator=g)
            k = torch.randn(1, hkv, nk, d, generator=g) + 4 * torch.randn(1, hkv, 1, d, generator=g)
            v = torch.randn(1, hkv, nk, d, generator=g)
            recipe = get_recipe("qk_int8_pv_fp8").replace(block_k=block_k, granularity=granularity)
            qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
            assert qz.v_mean is None and qz.delta_s is None
        else:  # no key (or no query): operands of the right shapes, never read as values
            qz = kg.QuantizedQKV(
                q=torch.randint(-127, 128, (1, hq, nq, d), generator=g, dtype=torch.int8),
                q_scale=torch.rand(1, hq, nq if per_token else -(-nq // kg.BLOCK_M), generator=g),
                k=torch.randint(-127, 128, (1, hkv, nk, d), generator=g, dtype=torch.int8),
                k_scale=torch.rand(1, hkv, nk if per_token else -(-nk // block_k), generator=g),
                v=torch.randn(1, hkv, nk, d, generator=g).to(torch.float8_e4m3fn),
                v_scale=torch.rand(1, hkv, d, generator=g), v_mean=None, delta_s=None,
                lse_shift=torch.randn(1, hq, nq, generator=g))
        alone.append(qz if nq and nk else None)
        parts["q"].append(qz.q[0].transpose(0, 1))
        parts["qs"].append(qz.q_scale[0])
        parts["k"].append(qz.k[0].transpose(0, 1))
        parts["ks"].append(qz.k_scale[0])
        parts["v"].append(qz.v[0].transpose(0, 1))
        parts["vs"].append(qz.v_scale[0])
        parts["lsh"].append(qz.lse_shift[0])
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    store = torch.full((hkv, d, packed_v_tokens(sum(lens_k), len(lens_k))), 0x7F,
                       dtype=torch.uint8).view(torch.float8_e4m3fn)
    for start, nk, v in zip(packed_v_starts(cu_k).tolist(), lens_k, parts["v"]):
        store[..., start:start + -(-nk // 16) * 16] = 0.0
        store[..., start:start + nk] = v.permute(1, 2, 0)
    def blocks(scales):  # per block: [B, H, most blocks], past a sequence's blocks NaN
        out = torch.full((len(scales), scales[0].shape[0], max(x.shape[1] for x in scales)),
                         float("nan"))
        for i, x in enumerate(scales):
            out[i, :, :x.shape[1]] = x
        return out

    def scales(name):
        return torch.cat(parts[name], 1).contiguous() if per_token else blocks(parts[name])

    packed = kg.QuantizedQKV(
        q=torch.cat(parts["q"]).contiguous(), q_scale=scales("qs"),
        k=torch.cat(parts["k"]).contiguous(), k_scale=scales("ks"),
        v=store.permute(2, 0, 1), v_scale=torch.stack(parts["vs"]),
        v_mean=None, delta_s=None, lse_shift=torch.cat(parts["lsh"], 1).contiguous())

    def seqs(lens):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        return Seqs(batch=len(lens), max_len=max(lens), cu_seqlens=cu)

    return packed, seqs(lens_q), seqs(lens_k), alone


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d", VARLEN)
@pytest.mark.parametrize("block_k", kg.BLOCK_NS, ids=lambda n: f"k{n}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_varlen_equals_each_sequence_alone_bit_for_bit(lens_q, lens_k, hq, hkv, d, block_k,
                                                              causal):
    """Each packed sequence as the twin on that sequence alone (causal: aligned bottom-right in
    each); a sequence with queries and no key gives rows of 0 and LSE -inf, as the Triton
    kernel."""
    _packed_equals_each_sequence_alone(lens_q, lens_k, hq, hkv, d, block_k, causal, "per_token")


def _packed_equals_each_sequence_alone(lens_q, lens_k, hq, hkv, d, block_k, causal, granularity):
    qz, sq, sk, alone = packed_operands(lens_q, lens_k, hq, hkv, d, block_k, granularity)
    out = torch.empty(qz.q.shape, dtype=torch.float32)  # NaN-poisoned (conftest)
    with on_cpu("eager"):
        lse = kg.attention(qz, out=out, pv="fp8", granularity=granularity, block_q=kg.BLOCK_M,
                           block_k=block_k, causal_offset=0 if causal else None,
                           return_lse=True, seqs_q=sq, seqs_k=sk)
    assert lse.shape == (hq, qz.q.shape[0])
    cu = sq.cu_seqlens.tolist()
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(cu[i], cu[i + 1])
        if alone[i] is None:
            assert bool((out[rows] == 0).all()) and bool(torch.isneginf(lse[:, rows]).all()), i
            continue
        want, want_lse = twin(alone[i], block_k, nk - nq if causal else None, granularity)
        assert_bits(out[rows], want[0].transpose(0, 1), f"out of sequence {i}")
        assert_bits(lse[:, rows], want_lse[0], f"lse of sequence {i}")


@pytest.mark.parametrize("old,new", [
    ("V + hk * svh + packed_v_start(k_start, b)", "V + hk * svh + k_start"),  # K's first key
    ("packed_v_start(k_start, b)", "packed_v_start(k_start, 0)"),  # no room for the padding
], ids=["V-base-not-16-byte-aligned", "V-base-without-the-padding"])
def test_the_check_catches_varlen_breaks(old, new):
    """Sequence 1 starts at key 1: V's descriptor base is where the quantization pass stored the
    sequence, a multiple of 16 tokens (TMA's alignment, which the model enforces) past the
    previous sequences and their padding."""
    qz, sq, sk, alone = packed_operands([1, 130, 77, 5], [1, 140, 200, 19], 2, 2, 64, 64)
    broken = {gb.descriptors.fn: mutant(gb.descriptors, old, new)}
    out = torch.empty(qz.q.shape, dtype=torch.float32)
    try:
        with on_cpu(overrides=broken):
            kg.attention(qz, out=out, pv="fp8", granularity="per_token", block_q=kg.BLOCK_M,
                         block_k=64, causal_offset=None, return_lse=False, seqs_q=sq, seqs_k=sk)
    except gluon_cpu.ScheduleError:
        return
    want, _ = twin(alone[1], 64, None)
    assert not torch.equal(out[1:131], want[0].transpose(0, 1))


def per_block_operands(b, hq, hkv, nq, nk, d, block_k):
    g = torch.Generator().manual_seed(3 * nq + nk + d)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + 4 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    recipe = get_recipe("qk_int8_pv_fp8").replace(block_k=block_k, granularity="per_block")
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    return dataclasses.replace(qz, v=token_contiguous(qz.v))


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", [SHAPES[i] for i in (1, 2, 4, 5, 7)])
@pytest.mark.parametrize("block_k", kg.BLOCK_NS, ids=lambda n: f"k{n}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_per_block_scales_equal_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, block_k,
                                                           causal):
    """``granularity="per_block"``: one Q scale per 128 rows, one K scale per key block."""
    qz = per_block_operands(b, hq, hkv, nq, nk, d, block_k)
    co = offset_of(nq, nk, causal, offset)
    with gluon_cpu.canonical_reductions():
        want, want_lse = quantized_attention(qz, pv="fp8", granularity="per_block",
                                             block_q=kg.BLOCK_M, block_k=block_k,
                                             causal_offset=co)
    out = torch.empty(qz.q.shape, dtype=torch.float32)
    with on_cpu("eager"):
        lse = kg.attention(qz, out=out, pv="fp8", granularity="per_block", block_q=kg.BLOCK_M,
                           block_k=block_k, causal_offset=co, return_lse=True)
    assert_bits(out, want, "out")
    assert_bits(lse, want_lse, "lse")


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d", VARLEN)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_varlen_per_block_equals_each_sequence_alone(lens_q, lens_k, hq, hkv, d, causal):
    _packed_equals_each_sequence_alone(lens_q, lens_k, hq, hkv, d, 64, causal, "per_block")


def fp16_operands(b, hq, hkv, nq, nk, d, block_k, granularity, dtype):
    """``qk_int8_pv_fp16`` operands: fp16 V ``[B, H, N, D]`` as the pass leaves it (scaled by a
    power of two per channel when the inputs are not fp16)."""
    g = torch.Generator().manual_seed(5 * nq + nk + d)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + 4 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    recipe = get_recipe("qk_int8_pv_fp16").replace(block_k=block_k, granularity=granularity)
    return quantize_qkv(q.to(dtype), k.to(dtype), v.to(dtype), recipe, d**-0.5,
                        need_lse_shift=True, backend="reference")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", [SHAPES[i] for i in (1, 2, 5, 7)])
@pytest.mark.parametrize("block_k", kg.BLOCK_NS, ids=lambda n: f"k{n}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("granularity,dtype", [("per_block", torch.float16),
                                               ("per_token", torch.bfloat16)],
                         ids=["per_block-fp16", "per_token-bf16"])
def test_gluon_fp16_pv_equals_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, block_k, causal,
                                                   policy, granularity, dtype):
    """``pv="fp16"``: P̃ rounded to fp16 (no 448 offset), V ``[keys, D]`` in shared memory as
    the wgmma's B operand; fp16 inputs (V unscaled) and bf16 ones (V with a power-of-two scale
    per channel)."""
    qz = fp16_operands(b, hq, hkv, nq, nk, d, block_k, granularity, dtype)
    assert (qz.v_scale is None) == (dtype == torch.float16)
    co = offset_of(nq, nk, causal, offset)
    with gluon_cpu.canonical_reductions():
        want, want_lse = quantized_attention(qz, pv="fp16", granularity=granularity,
                                             block_q=kg.BLOCK_M, block_k=block_k,
                                             causal_offset=co)
    out = torch.empty(qz.q.shape, dtype=torch.float32)
    with on_cpu(policy):
        lse = kg.attention(qz, out=out, pv="fp16", granularity=granularity, block_q=kg.BLOCK_M,
                           block_k=block_k, causal_offset=co, return_lse=True)
    assert_bits(out, want.float(), "out")
    assert_bits(lse, want_lse, "lse")
