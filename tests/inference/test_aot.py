"""Ahead-of-time compilation for GPU targets on a CPU machine: the PTX of each recipe's kernels shows
the intended tensor-core instructions, and ptxas reports registers and spills.

What Triton 3.6 emits for the attention kernel (BLOCK_M=128, BLOCK_N=64, D=128):

| target  | INT8 Q·Kᵀ                                              | P·V (fp16 / FP8)                        |
|---------|--------------------------------------------------------|-----------------------------------------|
| sm_80   | mma.sync m16n8k32 s32.s8.s8                            | mma.sync m16n8k16 f16 / (FP8 refused)   |
| sm_90a  | wgmma m64n64k32 s32.s8.s8                              | wgmma m64n128k16 f16 / m64n128k32 e4m3  |
| sm_100a | mma.sync m16n8k32 s32.s8.s8 (no tcgen05 kind::i8)      | tcgen05.mma kind::f16 / kind::f8f6f4    |
| sm_120a | mma.sync m16n8k32 s32.s8.s8                            | mma.sync m16n8k16 f16 / m16n8k32 e4m3   |

Triton 3.8 and 3.9 put sm_100a's INT8 Q·Kᵀ on tcgen05.mma kind::i8 too (the rest as above).
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from lowbit_attn.tools import aot, sass
from lowbit_attn.inference import kernel_int8 as attn_fwd_int8
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.core.variants import Variant

pytestmark = pytest.mark.aot

ATTENTION = "_attn_fwd_int8_kernel"
INT8_WGMMA = "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8"
FP8_WGMMA = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
F16_WGMMA = "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"
INT8_MMA = "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"
FP8_MMA = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
F16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
TCGEN05_F8 = "tcgen05.mma.cta_group::1.kind::f8f6f4"
TCGEN05_F16 = "tcgen05.mma.cta_group::1.kind::f16"
TCGEN05_I8 = "tcgen05.mma.cta_group::1.kind::i8"

# Kernels one call launches: the statistics, the quantization (Q with K and V), the attention.
LAUNCHES = ["_channel_stats_kernel", "_quantize_kernel", ATTENTION]


COMPILED = [
    ("qk_int8_pv_fp8", "sm_90a"),
    ("qk_int8_pv_fp16", "sm_90a"),
    ("qk_int8_pv_fp16", "sm_80"),
    ("qk_int8_pv_fp8", "sm_100a"),
    ("qk_int8_pv_fp16", "sm_100a"),
    ("qk_int8_pv_fp8", "sm_120a"),
    ("qk_int8_pv_fp16", "sm_120a"),
]


@pytest.fixture(scope="module")
def compiled():
    """``compiled(recipe, arch)`` → reports, each (recipe, arch) compiled once per module."""
    cache: dict[tuple[str, str], list[aot.KernelReport]] = {}

    def get(recipe: str, arch: str) -> list[aot.KernelReport]:
        if (recipe, arch) not in cache:
            cache[(recipe, arch)] = aot.compile_recipe(recipe, arch, head_dim=128)
        return cache[(recipe, arch)]

    return get


def attention_report(reports: list[aot.KernelReport]) -> aot.KernelReport:
    (report,) = [r for r in reports if r.kernel == ATTENTION]
    return report


def describe(r: aot.KernelReport) -> str:
    return (f"{r.kernel} on {r.arch}: {r.num_warps} warps, {r.num_stages} stages, "
            f"{r.registers} registers, spills {r.spill_stores}/{r.spill_loads} B, "
            f"instructions {r.instructions}, error {r.error}")


@pytest.mark.parametrize("recipe,arch", COMPILED, ids=[f"{r}-{a}" for r, a in COMPILED])
def test_every_kernel_compiles_and_assembles(compiled, recipe, arch):
    reports = compiled(recipe, arch)
    assert [r.kernel for r in reports][-1] == ATTENTION
    assert [r.kernel for r in reports] == LAUNCHES
    for r in reports:
        assert r.ok, describe(r)
        assert r.registers is not None and 0 < r.registers <= 255, describe(r)


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp8", "qk_int8_pv_fp16"])
def test_a_call_launches_three_kernels(recipe):
    """Statistics of Q, K and V in one launch; K, Q and V quantized in one more; the attention."""
    recorded = aot.record_launches(get_recipe(recipe), head_dim=64, seq_len=1024)
    assert [launch.name for launch in recorded] == LAUNCHES
    # one program per 32-token block (quant.int8.QUANT_ROWS: K's, Q's and V's, per-token scales)
    # and per (batch, head) of K, then of Q, then of V
    assert recorded[1].grid == (1024 // 32, 2 * 3)


@pytest.mark.parametrize("recipe,pv_form", [("qk_int8_pv_fp8", FP8_WGMMA),
                                            ("qk_int8_pv_fp16", F16_WGMMA)])
def test_hopper_uses_wgmma_for_both_products_without_spills(compiled, recipe, pv_form):
    r = attention_report(compiled(recipe, "sm_90a"))
    assert r.ok, describe(r)
    assert r.instructions.get(INT8_WGMMA, 0) > 0, describe(r)
    assert r.instructions.get(pv_form, 0) > 0, describe(r)
    assert not any(form.startswith("mma.sync") for form in r.instructions), describe(r)
    assert (r.num_warps, r.num_stages) == (8, 2)  # CONFIGS["sm_90"][0]
    assert r.spill_stores == 0 and r.spill_loads == 0, describe(r)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("recipe,granularity,block_k", [
    ("qk_int8_pv_fp8", "per_token", 64), ("qk_int8_pv_fp8", "per_block", 64),
    ("qk_int8_pv_fp16", "per_token", 64), ("qk_int8_pv_fp16", "per_block", 64),
    ("qk_int8_pv_fp8", "per_token", 128),
])
def test_every_hopper_candidate_fits_in_registers(recipe, granularity, block_k, d):
    """Each autotuning candidate on sm_90a (plain and pipelined loops, 2–4 stages) that the
    autotuner tries at this head dim and key block: wgmma for both products, no spills."""
    r8 = get_recipe(recipe).replace(granularity=granularity, block_k=block_k)
    attention = aot.record_launches(r8, head_dim=d)[-1]
    tried = aot.launch_candidates(attention, "sm_90a")
    assert tried == [c for c in attn_fwd_int8.CONFIGS["sm_90"][:5]  # the list before D = 256's
                     if attn_fwd_int8.fits(c.num_warps, d, block_k, c.kwargs["PIPELINE"])]
    assert any(c.kwargs["PIPELINE"] for c in tried) == (block_k * d <= 8192)
    for config in range(len(tried)):
        r = aot.compile_launch(attention, "sm_90a", config=config)
        assert r.ok and any(f.startswith("wgmma") and f.endswith("s32.s8.s8")
                            for f in r.instructions), describe(r)
        assert r.constexprs["BLOCK_M"] == 128, describe(r)  # whole query blocks below D = 256
        assert r.spill_stores == 0 and r.spill_loads == 0, (config, describe(r))


D256_CASES = [  # recipe, granularity, causal, varlen: what takes D = 256 (BLOCK_D 256)
    pytest.param("qk_int8_pv_fp8", "per_token", False, False, id="fp8-per_token"),
    pytest.param("qk_int8_pv_fp8", "per_thread", True, False, id="fp8-per_thread-causal"),
    pytest.param("qk_int8_pv_fp16", "per_block", True, False, id="fp16-per_block-causal"),
    pytest.param("qk_int8_pv_fp16", "per_token", True, True, id="fp16-per_token-causal-varlen"),
    pytest.param("qk_int8_pv_fp8", "per_token", True, True, id="fp8-per_token-causal-varlen"),
    pytest.param("qk_int8_pv_fp8", "per_token", False, True, id="fp8-per_token-varlen"),
]
D256_SHARED = {"sm_90a": 232448, "sm_89": 101376}  # bytes of shared memory a block may have


@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
@pytest.mark.parametrize("recipe,granularity,causal,varlen", D256_CASES)
def test_head_dim_256_candidates_do_not_spill(recipe, granularity, causal, varlen, arch):
    """Issue 44 item 6: at D = 256 the autotuner tries only halves of a query block (64 rows,
    ``M_SPLIT`` 2) on 8 warps, and none of them spills (a whole 128-row block spilled 708 B
    stored on sm_90a, 360 B on sm_89: benchmarks/NOTES.md). Below D = 256 nothing changed
    (the test above)."""
    r8 = get_recipe(recipe).replace(granularity=granularity)
    attention = aot.record_launches(r8, head_dim=256, causal=causal, varlen=varlen)[-1]
    if granularity == "per_thread" and arch == "sm_89":
        pytest.skip("per-thread groups are Hopper's; their 128-key blocks at D = 256 need more "
                    "shared memory than sm_89 has, halves or not (NOTES.md)")
    tried = aot.launch_candidates(attention, arch)
    family = attn_fwd_int8.CONFIGS[aot.config_family(arch)]
    block_n = attention.kwargs["BLOCK_N"]
    assert tried == [c for c in family if attn_fwd_int8.fits(
        c.num_warps, 256, block_n, bool(c.kwargs.get("PIPELINE")), c.kwargs.get("M_SPLIT", 1),
        num_stages=c.num_stages, varlen=varlen)]
    assert tried and all(c.kwargs.get("M_SPLIT") == 2 for c in tried)
    fitting = 0
    for config in range(len(tried)):
        r = aot.compile_launch(attention, arch, config=config)
        assert r.ok, describe(r)
        assert (r.num_warps, r.constexprs["BLOCK_M"]) == (8, 64), describe(r)
        assert r.spill_stores == 0 and r.spill_loads == 0, (config, describe(r))
        fitting += r.shared_memory <= D256_SHARED[arch]
    assert fitting, "no candidate fits in the block's shared memory"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_fp8_candidates_do_not_spill_below_head_dim_256(d, arch):
    """Packed sequences (causal, FP8 P·V) below D = 256: with V stored from a multiple of 16
    tokens per sequence no candidate spills; before, V's tile was loaded into registers and
    D = 128 spilled 4-584 B on sm_90a and 16-44 B on sm_89, D = 64's 4-warp candidate 24 B on
    sm_89 (2026-11-28, benchmarks/NOTES.md)."""
    attention = aot.record_launches(get_recipe("qk_int8_pv_fp8"), head_dim=d, causal=True,
                                    varlen=True)[-1]
    for config in range(len(aot.launch_candidates(attention, arch))):
        r = aot.compile_launch(attention, arch, config=config)
        assert r.ok and r.spill_stores == 0 and r.spill_loads == 0, (config, describe(r))


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("granularity", ["per_token", "per_block"])
def test_pipelined_candidate_runs_the_softmax_under_the_next_qk_wgmma(granularity, d):
    """In the SASS of the main (unmasked) loop, the plain candidate waits for Q·Kᵀ before any
    exp2; the pipelined one issues at least half of them while the next block's Q·Kᵀ is in flight,
    in fewer instructions (2026-11-22: 31 and 32 of 34 per token, 18 and 28 per block, at D=64 and
    128; 7 to 47 instructions fewer per 128×64 tile)."""
    attention = aot.record_launches(
        get_recipe("qk_int8_pv_fp8").replace(granularity=granularity), head_dim=d)[-1]
    configs = attn_fwd_int8.CONFIGS["sm_90"]
    plain = configs.index(attn_fwd_int8.LaunchConfig(8, 2, (("PIPELINE", False),)))
    pipelined = configs.index(attn_fwd_int8.LaunchConfig(8, 2, (("PIPELINE", True),)))
    main_loops = {}
    for config in (plain, pipelined):
        report = aot.compile_launch(attention, "sm_90a", config=config)
        main_loops[config] = sass.loops(sass.disassemble(report.cubin))[0]
    before = sass.exp2_under_mma(main_loops[plain])
    after = sass.exp2_under_mma(main_loops[pipelined])
    assert before.total == after.total == 34  # 32 scores + 2 rescale factors per thread
    assert before.under == 0
    assert after.under >= after.total // 2, after
    assert len(main_loops[pipelined]) < len(main_loops[plain])


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d", [64, 128])
def test_a_window_edge_block_costs_little_more_than_a_whole_one(d):
    """A 512-token window (issue 44's row) on sm_90a, the measured candidate (8 warps, 3 stages,
    pipelined): its key-block loops are the window's left edge (masked), the whole blocks and the
    diagonal (masked); each masked tile runs at most 1.5× the instructions of a whole one, its
    mask two compares per score against limits found once per row (``window_limits``).
    2026-12-01: 682 / 474 / 668 at D = 128, 581 / 404 / 570 at D = 64; the per-score rule it
    replaced, 908 / 464 / 890 and 818 / 406 / 794 (NOTES §30)."""
    attention = aot.record_launches(get_recipe("qk_int8_pv_fp8"), head_dim=d, causal=True,
                                    seq_len=16384, variant=Variant(left=511, right=0))[-1]
    measured = attn_fwd_int8.LaunchConfig(8, 3, (("PIPELINE", True),))
    report = aot.compile_launch(attention, "sm_90a",
                                config=attn_fwd_int8.CONFIGS["sm_90"].index(measured))
    assert (report.num_warps, report.num_stages, report.constexprs["WINDOWED"]) == (8, 3, True)
    edge, whole, diagonal = (len(body) for body in
                             sass.key_block_loops(sass.disassemble(report.cubin)))
    assert max(edge, diagonal) <= 1.5 * whole, (edge, whole, diagonal)
    assert report.spills == 0


def test_hopper_quantizers_use_no_tensor_cores_and_do_not_spill(compiled):
    for r in compiled("qk_int8_pv_fp8", "sm_90a"):
        if r.kernel != ATTENTION:
            assert r.ok and r.instructions == {} and r.spills == 0, describe(r)


def test_ampere_uses_mma_sync_for_int8_and_fp16(compiled):
    r = attention_report(compiled("qk_int8_pv_fp16", "sm_80"))
    assert r.ok, describe(r)
    assert r.instructions.get(INT8_MMA, 0) > 0, describe(r)
    assert r.instructions.get(F16_MMA, 0) > 0, describe(r)
    assert set(r.instructions) == {INT8_MMA, F16_MMA}, describe(r)


def test_fp8_pv_is_refused_before_sm_89():
    """Why ``doctor`` calls qk_int8_pv_fp8 unsupported on Ampere: Triton refuses E4M3 there."""
    r = attention_report(aot.compile_recipe("qk_int8_pv_fp8", "sm_80"))
    assert not r.ok and "fp8e4nv" in r.error


@pytest.mark.parametrize("recipe,pv_form", [("qk_int8_pv_fp8", TCGEN05_F8),
                                            ("qk_int8_pv_fp16", TCGEN05_F16)])
def test_blackwell_datacenter_uses_tcgen05_for_pv(compiled, recipe, pv_form):
    """sm_100a: P·V on tcgen05; the INT8 Q·Kᵀ on tensor cores too: Triton 3.6 lowers it to
    mma.sync (no kind::i8), Triton 3.8 and 3.9 to tcgen05 kind::i8."""
    r = attention_report(compiled(recipe, "sm_100a"))
    assert r.ok, describe(r)
    assert r.instructions.get(pv_form, 0) > 0, describe(r)
    assert r.instructions.get(INT8_MMA, 0) + r.instructions.get(TCGEN05_I8, 0) > 0, describe(r)
    assert not any(f.startswith("wgmma") for f in r.instructions), describe(r)


@pytest.mark.parametrize("recipe,pv_form", [("qk_int8_pv_fp8", FP8_MMA),
                                            ("qk_int8_pv_fp16", F16_MMA)])
def test_blackwell_consumer_uses_mma_sync(compiled, recipe, pv_form):
    """sm_120a (RTX 50xx) has neither wgmma nor tcgen05: INT8 and FP8 on mma.sync."""
    r = attention_report(compiled(recipe, "sm_120a"))
    assert r.ok, describe(r)
    assert set(r.instructions) == {INT8_MMA, pv_form}, describe(r)


def test_launch_specialization_matches_the_launchers():
    """The recorded launch is specialized as Triton's launcher would: unused optional inputs are
    constexpr None, unit strides constexpr 1, the FP8 V operand token-contiguous."""
    launches = aot.record_launches(get_recipe("qk_int8_pv_fp8"), head_dim=128)
    jit, values, options = aot._unwrap(launches[-1], "sm_90")
    signature, constexprs, attrs = aot.specialize(jit, values, "sm_90a")
    assert jit.__name__ == ATTENTION
    assert signature["q"][0] == "*i8" and signature["V"] == "*fp8e4nv" and signature["O"] == "*fp16"
    for name in ("VM", "DS", "LSH", "LSE", "CUQ", "CUK"):
        assert signature[name] == "constexpr" and constexprs[name] is None
    v_strides = [p.name for p in jit.params].index("v_strides")  # (batch, head, token, dim)
    assert constexprs[(v_strides, 2)] == 1 and signature["v_strides"][3] == "i32"  # V [B, H, D, N']
    assert constexprs["EXACT_FP8"] is False and constexprs["PV_FP8"] is True
    assert constexprs["PIPELINE"] is False
    assert options == {"num_warps": 8, "num_stages": 2}


@triton.jit
def _strided_copy(X, Y, x_strides, y_strides, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs * x_strides[1] + x_strides[0], mask=offs < n)
    tl.store(Y + offs * y_strides[0], x, mask=offs < n)


def test_tuple_arguments_are_specialized_element_by_element():
    """A tensor's strides passed as one tuple argument: each element gets the launcher's
    specialization (1 becomes a constexpr, multiples of 16 are marked divisible), and the kernel
    compiles with the unit stride folded in."""
    x, y = torch.zeros(64), torch.zeros(64)
    launch = aot.Launch(_strided_copy, (x, y), dict(x_strides=(32, 1), y_strides=(1,), n=64,
                                                     BLOCK=64), grid=(1,))
    jit, values, _ = aot._unwrap(launch, "sm_90")
    signature, constexprs, attrs = aot.specialize(jit, values, "sm_90a")
    assert signature["x_strides"] == ("i32", "constexpr") and signature["y_strides"] == ("constexpr",)
    assert constexprs[(2, 1)] == 1 and constexprs[(3, 0)] == 1 and constexprs["BLOCK"] == 64
    assert attrs[(2, 0)] == [["tt.divisibility", 16]] and (4,) in attrs  # 32 and n = 64
    report = aot.compile_launch(launch, "sm_90a")
    assert report.ok, describe(report)


@pytest.mark.interpreter
def test_compiles_identically_after_the_interpreter_ran(compiled, monkeypatch):
    """Triton 3.6's interpreter leaves ``tl.core`` patched after a kernel calls ``tl.max``; AOT
    must see past it and produce the same PTX as before."""
    before = attention_report(compiled("qk_int8_pv_fp8", "sm_90a"))
    assert before.ok, describe(before)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    import lowbit_attn

    q = torch.randn(1, 1, 20, 16)
    lowbit_attn.attention(q, q, q, recipe="qk_int8_pv_fp8")  # interpreted: uses tl.max, tl.sum
    monkeypatch.setattr(aot, "_COMPILED", {})
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")  # no Triton cache hit: really compile
    after = attention_report(aot.compile_recipe("qk_int8_pv_fp8", "sm_90a"))
    assert after.ok, describe(after)
    assert _code(after.ptx) == _code(before.ptx)


def _code(ptx: str) -> str:
    """PTX without its debug information (``.file`` directives and ``.debug_*`` sections), which
    spells out the checkout's path: a Triton cache hit may come from another checkout."""
    code = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(".file"))


def test_instruction_parsing_strips_operands_and_counts():
    ptx = """
    wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%r1,%r2}, %rd1, %rd2, 0;
    wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%r1,%r2}, %rd3, %rd4, %p1;
    wgmma.fence.sync.aligned;
    @%p221 tcgen05.mma.cta_group::1.kind::f8f6f4 [ %r2 + 0 ], %rd293, %rd294, %r1192, %p220;
    mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32 {%r1}, {%r2}, {%r3}, {%r4};
    """
    assert aot.tensor_core_instructions(ptx) == {
        "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32": 1,
        "tcgen05.mma.cta_group::1.kind::f8f6f4": 1,
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8": 2,
    }


def test_ptxas_log_parsing():
    log = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'kern' for 'sm_120a'
ptxas info    : Function properties for kern
    88 bytes stack frame, 88 bytes spill stores, 84 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 88 bytes cumulative stack size
"""
    assert aot.parse_ptxas_log(log, "kern") == {
        "registers": 255, "stack_frame": 88, "spill_stores": 88, "spill_loads": 84,
    }
    with pytest.raises(ValueError, match="entry function"):
        aot.parse_ptxas_log("ptxas info    : 11 bytes gmem")


@pytest.mark.parametrize("arch,expected", [("sm_90", "sm_90a"), ("sm_100a", "sm_100a"),
                                           ("sm_89", "sm_89"), ("sm_120", "sm_120a")])
def test_normalize_arch(arch, expected):
    assert aot.normalize_arch(arch) == expected


@pytest.mark.parametrize("arch", ["sm_70", "sm_75", "hopper", "", "sm_90b"])
def test_unknown_arch_is_a_value_error_naming_it(arch):
    with pytest.raises(ValueError, match="arch must be one of"):
        aot.normalize_arch(arch)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="head_dim"):
        aot.compile_recipe("qk_int8_pv_fp8", "sm_90a", head_dim=0)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):  # what attention() refuses
        aot.compile_recipe("qk_fp4_pv_fp4", "sm_100a", head_dim=48)
    with pytest.raises(ValueError, match="config"):
        aot.compile_recipe("qk_int8_pv_fp8", "sm_90a", config=99)
    with pytest.raises(ValueError, match="dtype"):
        aot.compile_recipe("qk_int8_pv_fp8", "sm_90a", dtype=torch.int8)


def test_exact_recipe_launches_no_kernel():
    assert aot.compile_recipe("exact", "sm_90a") == []


def test_bundled_ptxas_exists():
    for arch in ("sm_90a", "sm_100a"):
        assert os.path.exists(aot.ptxas_path(arch))


def test_autotune_first_gives_each_kernel_its_first_candidate_alone(monkeypatch):
    """``LOWBIT_ATTN_AUTOTUNE=first`` (the GPU test runs): one candidate, the family's first, so a
    new shape compiles one kernel; ``all`` (default) every candidate; anything else is refused by
    name."""
    from lowbit_attn.core.triton_helpers import triton_configs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's lists, not the interpreter's
    configs = attn_fwd_int8.CONFIGS
    every = triton_configs(configs, (9, 0))
    assert len(every) == len(configs["sm_90"]) > 1
    monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", "first")
    (first,) = triton_configs(configs, (9, 0))
    assert (first.num_warps, first.num_stages, first.kwargs) == (
        every[0].num_warps, every[0].num_stages, every[0].kwargs)
    monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", "fastest")
    with pytest.raises(ValueError, match=r"LOWBIT_ATTN_AUTOTUNE must be one of \('measured', "
                                         r"'all', 'first'\), got 'fastest'"):
        triton_configs(configs, (9, 0))


def _on_hopper(monkeypatch):
    """The prune filter's view of a compiled run on an sm_90 device (no GPU needed: it reads
    the capability and the interpreter flag only)."""
    from lowbit_attn.core import arch, triton_helpers

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_helpers, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(arch, "get_capability", lambda: (9, 0))


@pytest.mark.parametrize("mode", [None, "measured", "all", "first"])
def test_a_measured_launch_runs_its_measured_candidate_alone(monkeypatch, mode):
    """``LOWBIT_ATTN_AUTOTUNE=measured`` (the default): the INT8 forward as users call it on
    Hopper (qk_int8_pv_fp8, D = 128 and 64) keeps only the candidate ``core.measured`` names (8
    warps, 3 stages, pipelined: the H100's and the H200's), so Triton compiles and times that one
    only, and so do its windowed, softcapped and packed launches (``SAME_TILES``); a launch no
    entry covers (D = 96, per-thread scales, windowed or not) keeps every candidate; ``all``
    keeps every candidate; ``first`` the first."""
    from lowbit_attn.core.measured import MEASURED

    _on_hopper(monkeypatch)
    if mode is None:
        monkeypatch.delenv("LOWBIT_ATTN_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", mode)

    def kept(recipe, d, **call):
        launch = [x for x in aot.record_launches(recipe, head_dim=d, **call)
                  if x.name == "_attn_fwd_int8_kernel"][-1]
        return [(c.num_warps, c.num_stages, c.kwargs)
                for c in aot.launch_candidates(launch, "sm_90a")]

    token = get_recipe("qk_int8_pv_fp8")
    default = kept(token, 128)
    thread = kept(token.replace(granularity="per_thread"), 128)
    small = kept(token, 64)
    odd = kept(token, 96)
    # launches an entry matches but for core.measured.SAME_TILES (a window, softcap, packed)
    near = [kept(token, 128, causal=True, variant=Variant(left=511, right=0)),
            kept(token, 64, variant=Variant(softcap=30.0)), kept(token, 128, varlen=True),
            kept(token, 64, varlen=True, causal=True,
                 variant=Variant(left=127, right=0, softcap=30.0))]
    thread_window = kept(token.replace(granularity="per_thread"), 128, causal=True,
                         variant=Variant(left=511, right=0))
    entries = [m for m in MEASURED if m.kernel == "_attn_fwd_int8_kernel"]
    assert sorted(dict(m.match)["D"] for m in entries) == [64, 128]
    if mode in (None, "measured"):
        for entry in entries:
            assert [(entry.num_warps, entry.num_stages, dict(entry.meta))] == [
                (8, 3, {"PIPELINE": True})]
        assert default == small == [(8, 3, {"PIPELINE": True})]
        assert all(one == [(8, 3, {"PIPELINE": True})] for one in near), near
        assert len(thread) > 1 and len(odd) > 1 and len(thread_window) > 1
    elif mode == "all":
        assert len(default) == 7 and (8, 3, {"PIPELINE": True}) in default  # TRIALS too
        assert len(thread) > 1 and len(small) > 1 and all(len(one) > 1 for one in near)
    else:
        assert len(default) == len(thread) == len(small) == len(odd) == 1
        assert default != [(8, 3, {"PIPELINE": True})]  # the first is not the measured one


@pytest.mark.pinned_codegen  # Triton 3.9 spills 8 B at D = 128: a GPU run's Triton is 3.6
@pytest.mark.parametrize("d", [64, 128])
def test_trial_candidates_are_tried_only_when_asked_and_do_not_spill(monkeypatch, d):
    """``kernel_int8.TRIALS`` (64-row programs on one warpgroup, no GPU has timed them): the
    autotuner tries them under ``LOWBIT_ATTN_AUTOTUNE=all`` only, for dense launches at D ≤ 128
    (packed ones spill 8 to 24 B at D = 128); compiled for sm_90a, windowed or not, 64-row
    programs of 4 warps with wgmma and no spills, in at most 255 registers (two programs per
    SM: 2 × 128 threads × 256 ≤ 65 536)."""
    _on_hopper(monkeypatch)
    token = get_recipe("qk_int8_pv_fp8")
    launches = [[x for x in aot.record_launches(token, head_dim=d, causal=True, seq_len=4096,
                                                 variant=variant, varlen=varlen)
                 if x.name == ATTENTION][-1]
                for variant, varlen in ((None, False), (Variant(left=511, right=0), False),
                                        (None, True))]
    monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", "all")
    tried = [aot.launch_candidates(launch, "sm_90a") for launch in launches]
    trials = [(c.num_warps, c.num_stages, c.kwargs) for c in attn_fwd_int8.TRIALS]
    for dense in tried[:2]:
        assert [(c.num_warps, c.num_stages, c.kwargs) for c in dense[-2:]] == trials
    assert not any(attn_fwd_int8._trial(c) for c in tried[2])  # packed
    for launch in launches[:2]:
        for index in (len(tried[0]) - 2, len(tried[0]) - 1):
            r = aot.compile_launch(launch, "sm_90a", config=index)
            assert r.ok and r.num_warps == 4 and r.constexprs["BLOCK_M"] == 64, describe(r)
            assert any(f.startswith("wgmma") for f in r.instructions), describe(r)
            assert r.spills == 0 and r.registers <= 255, describe(r)
    monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", "measured")
    assert not any(attn_fwd_int8._trial(c) for launch in launches
                   for c in aot.launch_candidates(launch, "sm_90a"))


def test_every_measured_entry_is_a_candidate_of_its_kernel():
    """Each entry of ``core.measured.MEASURED`` names a kernel of the package, a family of its
    ``CONFIGS`` and a candidate in that family's list, matches only the kernel's own launch
    arguments, and names the GPU run that measured it."""
    import inspect

    from lowbit_attn.core.measured import MEASURED

    modules = {name: module for module in aot.kernel_modules()
               for name, _ in inspect.getmembers(module) if name.startswith("_")}
    for m in MEASURED:
        module = modules[m.kernel]
        jit = aot.as_jit_function(getattr(module, m.kernel))
        assert {name for name, _ in m.match} <= set(jit.arg_names), m
        configs = module.CONFIGS[m.family]
        assert any((c.num_warps, c.num_stages) == (m.num_warps, m.num_stages)
                   and c.kwargs == {**c.kwargs, **dict(m.meta)} for c in configs), m
        assert "20" in m.source and ("H100" in m.source or "H200" in m.source), m
