"""The ``lowbit-attn`` command: ``doctor``, ``inspect`` (AOT), and the wiring of ``accuracy`` and
``bench`` to their modules."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types

import pytest
import torch

from helpers import pinned_codegen, needs_gluon
from lowbit_attn.tools import cli
from lowbit_attn.core.recipes import RECIPES, get_recipe


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_reports_versions_environment_and_recipes(capsys, monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    for field in ("python", "torch", "triton", "CUDA", "GPU", "target arch", "LOWBIT_ATTN_ARCH",
                  "LOWBIT_ATTN_BACKEND", "TRITON_INTERPRET", "CUDA tensors", "CPU tensors",
                  "sageattention", "matplotlib"):
        assert field in out, f"doctor does not print {field!r}:\n{out}"
    for name in RECIPES:
        assert f"  {name} " in out
    (cpu_line,) = [line for line in out.splitlines() if line.startswith("CPU tensors")]
    assert cpu_line.split()[-1] == "reference"
    assert "FP4 (qk_fp4_pv_fp4, qk_mxfp4_pv_mxfp4) here: reference" in out
    assert "cannot compile an NVFP4 dot_scaled for sm_90" in out


def test_doctor_survives_a_bad_backend_setting(capsys, monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "bogus")
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    assert "error: LOWBIT_ATTN_BACKEND must be one of" in out


def test_doctor_prints_every_variable_and_flags_a_bad_value(capsys, monkeypatch):
    """Each variable the package reads, set or not; a value a call would refuse is named with the
    choices (on a CPU no call reads LOWBIT_ATTN_AUTOTUNE, so doctor is where it shows)."""
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "bogus")
    monkeypatch.setenv("LOWBIT_ATTN_BWD_KERNEL", "sm90")
    monkeypatch.setenv("LOWBIT_ATTN_CACHE", "/tmp/models")
    monkeypatch.delenv("LOWBIT_ATTN_LAUNCH", raising=False)
    code, out, _ = run(capsys, "doctor")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()
             if line.startswith(("LOWBIT_", "TRITON_"))}
    assert set(lines) >= {"LOWBIT_ATTN_BWD_KERNEL", "LOWBIT_ATTN_CACHE", "LOWBIT_ATTN_AUTOTUNE",
                          "LOWBIT_ATTN_TRAIN_DQ", "LOWBIT_ATTN_LAUNCH"}
    assert lines["LOWBIT_ATTN_KERNEL"].split()[1:] == [
        "bogus", "(error:", "must", "be", "one", "of", "measured,", "triton,", "gluon,", "sm90)"]
    assert lines["LOWBIT_ATTN_BWD_KERNEL"].split()[1:] == ["sm90"]
    assert lines["LOWBIT_ATTN_LAUNCH"].split()[1:] == ["(unset)"]


@pytest.mark.parametrize(
    "recipe,device,cap,backend,expected",
    [
        ("qk_int8_pv_fp8", "cuda", (9, 0), "triton", "native"),
        ("qk_int8_pv_fp8", "cuda", (8, 9), "triton", "native"),
        ("qk_int8_pv_fp8", "cuda", (8, 0), "triton", "unsupported (needs sm_89+)"),
        ("qk_int8_pv_fp16", "cuda", (8, 0), "triton", "native"),
        ("qk_int8_pv_fp16", "cuda", (7, 5), "triton", "unsupported (needs sm_80+)"),
        ("qk_int8_pv_fp16", "cuda", None, "triton", "no GPU"),
        ("qk_int8_pv_fp8", "cuda", (9, 0), "reference", "reference"),
        ("exact", "cuda", (9, 0), "triton", "reference"),
        ("exact", "cuda", None, "triton", "no GPU"),
        ("qk_int8_pv_fp8", "cpu", None, "reference", "reference"),
        ("qk_int8_pv_fp8", "cpu", None, "triton", "interpreter"),
        ("qk_fp4_pv_fp4", "cuda", (10, 0), "triton", "native (FP4 tensor cores)"),
        ("qk_mxfp4_pv_mxfp4", "cuda", (12, 0), "triton", "native (FP4 tensor cores)"),
        ("qk_fp4_pv_fp4", "cuda", (9, 0), "triton", "emulated (bf16 MMA)"),
        ("qk_fp4_pv_fp4", "cuda", (7, 5), "triton", "unsupported (needs sm_80+)"),
        ("qk_fp4_pv_fp4", "cpu", None, "triton", "interpreter (FP4 emulated)"),
        ("qk_fp4_pv_fp4", "cpu", None, "reference", "reference"),
    ],
)
def test_recipe_status(recipe, device, cap, backend, expected):
    assert cli.recipe_status(get_recipe(recipe), device, cap, backend) == expected


@pytest.mark.aot
def test_inspect_prints_tensor_core_instructions_registers_and_spills(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp8")
    assert code == 0, out
    assert "qk_int8_pv_fp8 for sm_90a (head dim 128, non-causal, float16)" in out
    assert "_attn_fwd_int8_kernel" in out and "_quantize_kernel" in out
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8" in out
    assert "f32.e4m3.e4m3" in out
    assert "registers" in out and "B stored" in out and "B loaded" in out
    assert "tensor cores  none" in out  # the quantizers


def _key_loops(out: str) -> list[float]:
    line = next(x for x in out.splitlines() if x.startswith("  key loops"))
    return [float(x) for x in re.findall(r"([0-9.]+) per score", line)]


@pytest.mark.aot
def test_inspect_counts_the_key_loops_and_takes_the_llm_variants(capsys):
    """Issue 44: the default loop's instructions per score, and what a softcap, sinks and a
    window change; off, the loops are those of the plain kernel (NOTES §20)."""
    args = ("inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp8", "--head-dim", "64")
    plain = _key_loops(run(capsys, *args)[1])
    capped = _key_loops(run(capsys, *args, "--softcap", "30")[1])
    window = _key_loops(run(capsys, *args, "--causal", "--window", "127,0")[1])
    assert len(plain) == len(capped) == 2 and len(window) == 3  # masked edges around whole blocks
    assert capped[0] > plain[0] + 5  # tanh per score: ~10 instructions
    if pinned_codegen():  # NOTES §20: D = 64, plain 13.41 per score, softcap 23.19; the
        # window's whole blocks 13.44 since its edges mask against per-row limits (§30; 13.59)
        assert plain[0] == pytest.approx(13.41, abs=0.01)
        assert capped[0] == pytest.approx(23.19, abs=0.01)
        assert window[1] == pytest.approx(13.44, abs=0.01)


def test_a_window_with_an_unbounded_side_needs_no_equals_sign():
    """``--window -1,0`` (the help's "-1 for an unbounded side"): argparse read ``-1,0`` as an
    option ("expected one argument") unless written ``--window=-1,0``."""
    for argv in (["inspect", "--arch", "sm_90a", "--window", "-1,0"],
                 ["inspect", "--arch", "sm_90a", "--window=-1,0"],
                 ["inspect", "--arch", "sm_90a", "--window", "5,-1"]):
        argv = cli._joined_negative_pairs(argv)
        args = cli.build_parser(argv).parse_args(argv)
        assert args.window == ((-1, 0) if "-1,0" in argv[-1] else (5, -1))


@pytest.mark.parametrize("extra", [("--recipe", "kv_int8_fp8", "--sinks"),
                                   ("--recipe", "sagebwd_int8", "--softcap", "30"),
                                   ("--kernel", "sm90", "--window", "3,0"),
                                   ("--window", "3"), ("--softcap", "-1"), ("--chunk", "0")])
def test_inspect_refuses_variants_it_cannot_compile(capsys, extra):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--arch", "sm_90a", *extra])
    err = capsys.readouterr().err
    assert "--window" in err or "--softcap" in err or "--chunk" in err, err


@pytest.mark.aot
def test_inspect_json(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90", "--recipe", "qk_int8_pv_fp16",
                       "--json")
    assert code == 0
    reports = json.loads(out)
    attn = reports[-1]
    assert attn["kernel"] == "_attn_fwd_int8_kernel" and attn["arch"] == "sm_90a"
    assert any(form.endswith("f32.f16.f16") for form in attn["instructions"])
    assert attn["spills"] == 0 and attn["error"] is None
    assert isinstance(attn["registers"], int)


@pytest.mark.aot
def test_inspect_vsa_prints_every_kernel_with_the_wide_wgmma_gate(capsys):
    """``--recipe vsa``: the fine stage's kernels (tiling, 16-bit forward, dQ, dK/dV, the 8-bit
    forward with its quantizers), each with the gate of issues 28 and 30, and a count; at D = 64
    every one passes (Triton 3.6: 4 warps, 64-token tiles, no spills)."""
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "vsa", "--head-dim",
                       "64", "--dtype", "bfloat16")
    assert code == 0, out
    assert "vsa for sm_90a (head dim 64, non-causal, bfloat16)" in out
    for kernel in ("_tile_kernel", "_untile_kernel", "_vsa_fwd_kernel", "_vsa_dq_kernel",
                   "_vsa_dkdv_kernel", "_quantize_kernel"):
        assert kernel in out, kernel
    assert "INT8_QK=True" in out and "INT8_QK=False" in out  # both forwards
    kernels = out.count("\n  launch ")
    assert out.count("\n  gate          ") == kernels
    assert f"gate: {kernels} of {kernels} kernels pass" in out, out


@pytest.mark.aot
def test_inspect_head_dim_256_varlen_and_the_kv_cache_read(capsys):
    """Issue 44 item 6: ``--varlen`` compiles the packed-sequence call, the KV-cache recipes the
    cache's read; at D = 256 the forward takes halves of a query block, and nothing spills."""
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp16",
                       "--head-dim", "256", "--varlen")
    assert code == 0, out
    assert "(head dim 256, non-causal, varlen, float16)" in out
    assert "VARLEN=True" in out and "BLOCK_M=64" in out and "M_SPLIT=2" in out
    assert out.count("spills 0 B stored, 0 B loaded") == out.count("\n  registers "), out
    code, out, _ = run(capsys, "inspect", "--arch", "sm_89", "--recipe", "kv_int8_int8",
                       "--head-dim", "256")
    assert code == 0, out
    assert "_decode_split_kernel" in out and "_decode_merge_kernel" in out
    assert out.count("spills 0 B stored, 0 B loaded") == 2, out


def test_inspect_refuses_varlen_and_kv_cache_variants_it_has_not(capsys):
    for args, says in ((["--recipe", "vsa", "--varlen"], "--varlen"),
                       (["--recipe", "kv_int8_fp8", "--causal"], "--causal"),
                       (["--recipe", "kv_int8_fp8", "--config", "1"], "one launch configuration")):
        with pytest.raises(SystemExit):
            cli.main(["inspect", "--arch", "sm_90a", *args])
        assert says in capsys.readouterr().err


def test_inspect_vsa_refuses_causal_and_fp32(capsys):
    for extra in (["--causal"], ["--dtype", "float32"]):
        with pytest.raises(SystemExit):
            cli.main(["inspect", "--arch", "sm_90a", "--recipe", "vsa", *extra])
        assert ("not causal" if extra == ["--causal"] else "float16 or bfloat16") in \
            capsys.readouterr().err


def test_the_gate_names_narrow_products_and_spills():
    """``KernelReport.narrow_products``: ``mma.sync`` and wgmma narrower than N = 64 fail the
    gate; N ≥ 64 passes; the gate line says which, and the spills."""
    from lowbit_attn.tools.aot import KernelReport

    wide = "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8"
    narrow = "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16"
    sync = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    r = KernelReport("k", "sm_90a", {}, 8, 2, instructions={wide: 4, narrow: 8, sync: 2},
                     registers=255, spill_stores=4, spill_loads=4)
    assert r.narrow_products() == [narrow, sync]
    line = cli._gate_line(r)
    assert "misses" in line and "spills 8 B" in line and "8 x m64n32k16" in line
    ok = KernelReport("k", "sm_90a", {}, 4, 2, instructions={wide: 4}, registers=200,
                      spill_stores=0, spill_loads=0)
    assert ok.narrow_products() == [] and "passes" in cli._gate_line(ok)


@pytest.mark.aot
def test_inspect_failing_kernel_exits_1_and_says_why(capsys, monkeypatch):
    """A kernel that fails to compile is reported with the compiler's message, and the exit
    status is 1 (a compile error stood in for by a patched ``triton.compile``)."""
    from lowbit_attn.tools import aot

    def fails(*args, **kwargs):
        raise ValueError("type fp8e4nv not supported in this architecture")

    monkeypatch.setattr(aot.triton, "compile", fails)
    monkeypatch.setattr(aot, "_COMPILED", {})  # nothing compiled before this test is reused
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp8")
    assert code == 1
    assert "error" in out and "fp8e4nv" in out


@pytest.mark.aot
@pytest.mark.parametrize("kernel,recipe,api", [("gluon", "qk_int8_pv_fp8", "hopper"),
                                               ("gluon", "qk_fp4_pv_fp4", "blackwell")])
def test_inspect_gluon_on_another_triton_refuses_in_one_line(capsys, monkeypatch, kernel, recipe,
                                                             api):
    from lowbit_attn.core import triton_support

    monkeypatch.setitem(triton_support.GLUON_SERIES, api, ("3.99",))
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--arch", "sm_100a" if api == "blackwell" else "sm_90a", "--recipe",
                  recipe, "--kernel", kernel])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(rf"--kernel {kernel} is written for Gluon's \w+ API of Triton 3\.99\.x, "
                     r"found Triton \d+\.\d+", err), err


@pytest.mark.aot
@needs_gluon("hopper")
def test_inspect_sm90_prints_a_gate_per_granularity(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90", "--recipe", "qk_int8_pv_fp8",
                       "--kernel", "sm90")
    assert code == 0, out
    assert "one-warpgroup Gluon forward (head dim 128, 128-key blocks, non-causal" in out
    token, thread = out.split("\nper_token scales\n")[1].split("\nper_thread scales\n")
    if pinned_codegen():  # 3.9's code generation: 8.50 per score, over the gate
        assert "  gate          passes (P̃·V from registers" in thread, thread
    assert "PER_THREAD=True" in thread and "PER_THREAD=False" in token
    for report in (token, thread):
        assert "_attn_fwd_sm90_kernel" in report and "P̃·V A operand  registers" in report
        assert "A-register hazard: none (8 wgmma with register A checked)" in report
        assert re.search(r"\d CTAs per SM \(\d+ registers, \d+ B shared memory, 128 threads\)",
                         report)
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90", "--recipe", "qk_int8_pv_fp8",
                       "--kernel", "sm90", "--json")
    assert code == 0
    reports = json.loads(out)
    assert reports[0]["gates"]["passes"] is False  # per token: 9 per score
    assert reports[1]["gates"]["passes"] is pinned_codegen()


@pytest.mark.aot
@needs_gluon("hopper")
def test_inspect_gluon_on_hopper_is_the_sm90_forward(capsys):
    """``--kernel gluon`` with an INT8 recipe for sm_90a compiles what ``--kernel sm90`` does,
    as ``LOWBIT_ATTN_KERNEL=gluon`` runs it (the ping-pong forward is deleted)."""
    argv = ["inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp8", "--head-dim", "64",
            "--json"]
    code, gluon, _ = run(capsys, *argv, "--kernel", "gluon")
    assert code == 0, gluon
    _, sm90, _ = run(capsys, *argv, "--kernel", "sm90")
    reports = json.loads(gluon)
    assert [r["kernel"] for r in reports] == ["_attn_fwd_sm90_kernel"] * 2
    assert [r["gates"] for r in reports] == [r["gates"] for r in json.loads(sm90)]


@pytest.mark.aot
def test_inspect_kernel_triton_is_the_default_output(capsys):
    argv = ["inspect", "--arch", "sm_90a", "--recipe", "qk_int8_pv_fp8", "--head-dim", "64"]
    _, default, _ = run(capsys, *argv)
    _, named, _ = run(capsys, *argv, "--kernel", "triton")
    assert named == default and "gluon" not in default and "exp2 under" not in default


@pytest.mark.triton_internals
def test_inspect_exact_launches_nothing(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "exact")
    assert code == 0
    assert "launches no Triton kernel" in out


def _fail(*args, **kwargs):
    raise AssertionError("a usage error must stop before any work")


def usage_error(capsys, argv: list[str]) -> str:
    """Run ``lowbit-attn ARGV``, expect a usage error (exit 2, the usage and then exactly one
    error line, no traceback) and return that line."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [err.splitlines()[-1]] and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "--arch", "sm_70", "--recipe", "qk_int8_pv_fp8"], "argument --arch"),
    (["inspect", "--arch", "hopper"], "sm_90a"),
    (["inspect", "--recipe", "qk_int8_pv_fp8"], "--arch"),
    (["inspect", "--arch", "sm_90a", "--recipe", "int4"], "argument --recipe"),
    (["inspect", "--arch", "sm_90a", "--head-dim", "512"], "argument --head-dim"),
    (["inspect", "--arch", "sm_90a", "--head-dim", "0"], "argument --head-dim"),
    (["inspect", "--arch", "sm_90a", "--config", "-1"], "argument --config"),
    (["inspect", "--arch", "sm_100a", "--recipe", "qk_fp4_pv_fp4", "--head-dim", "48"],
     "multiple of 32, got 48"),
    ([], "COMMAND"),
    (["inspect", "--arch", "sm_90a", "--kernel", "cuda"], "argument --kernel"),
    (["inspect", "--arch", "sm_90a", "--kernel", "gluon-pingpong"], "argument --kernel"),
    pytest.param(["inspect", "--arch", "sm_100a", "--kernel", "gluon"],
                 "--kernel gluon: the Gluon forward is written for sm_90a only, got --arch sm_100a",
                 marks=needs_gluon("hopper")),
    pytest.param(["inspect", "--arch", "sm_90a", "--kernel", "gluon", "--recipe", "qk_fp4_pv_fp4"],
                 "--kernel gluon: the Gluon FP4 forward is written for sm_100a only, got --arch "
                 "sm_90a", marks=needs_gluon("blackwell")),
    pytest.param(["inspect", "--arch", "sm_100a", "--kernel", "sm90", "--recipe",
                  "qk_fp4_pv_fp4"],
                 "--kernel sm90: the FP4 recipes have one Gluon forward, --kernel gluon",
                 marks=needs_gluon("blackwell")),
    pytest.param(["inspect", "--arch", "sm_100a", "--kernel", "gluon", "--recipe",
                  "qk_mxfp4_pv_mxfp4", "--head-dim", "64"],
                 "--kernel gluon: the Gluon FP4 forward takes head dim 128, got --head-dim 64",
                 marks=needs_gluon("blackwell")),
    pytest.param(["inspect", "--arch", "sm_90a", "--kernel", "gluon", "--recipe",
                  "sagebwd_int8"],
                 "--kernel gluon: the Gluon forward runs the qk_int8_pv_fp8 and "
                 "qk_int8_pv_fp16", marks=needs_gluon("hopper")),
    pytest.param(["inspect", "--arch", "sm_90a", "--kernel", "gluon", "--head-dim", "96"],
                 "takes head dim 64 or 128, got --head-dim 96", marks=needs_gluon("hopper")),
    pytest.param(["inspect", "--arch", "sm_90a", "--kernel", "gluon", "--config", "1"],
                 "one launch configuration, got --config 1", marks=needs_gluon("hopper")),
])
def test_usage_errors_exit_2_with_a_clear_message(capsys, argv, needle):
    assert needle in usage_error(capsys, argv)


ACCURACY_USAGE_ERRORS = [
    pytest.param(["--families", ""], "argument --families: no family named", id="families-empty"),
    pytest.param(["--recipes", "auto"], "unknown recipe 'auto'; expected one of",
                 id="recipes-auto"),
    pytest.param(["--n", "0"], "argument --n: must be between 1 and 2147483647, got 0",
                 id="n-zero"),
    pytest.param(["--n", "-5"], "argument --n: must be between 1 and 2147483647, got -5",
                 id="n-negative"),
    pytest.param(["--n", "1e3"], "argument --n: expected int", id="n-float"),
    pytest.param(["--n-k", "0"], "argument --n-k: must be between 1 and", id="n-k-zero"),
    pytest.param(["--head-dim", "0"], "argument --head-dim: must be between 1 and 256", id="d-zero"),
    pytest.param(["--head-dim", "300"], "argument --head-dim: must be between 1 and 256",
                 id="d-300"),
    pytest.param(["--batch", "0"], "argument --batch: must be between 1 and", id="batch-zero"),
    pytest.param(["--heads", "0"], "argument --heads: must be between 1 and", id="heads-zero"),
    pytest.param(["--kv-heads", "0"], "argument --kv-heads: must be between 1 and",
                 id="kv-heads-zero"),
    pytest.param(["--heads", "3", "--kv-heads", "2"], "argument --kv-heads: must divide --heads",
                 id="kv-heads-ratio"),
    pytest.param(["--seed", "-1"], "argument --seed", id="seed"),
    pytest.param(["--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N",
                 id="device-bogus"),
    pytest.param(["--device", "meta"], "argument --device: expected cpu, cuda or cuda:N",
                 id="device-meta"),
    pytest.param(["--recipes", "qk_fp4_pv_fp4", "--head-dim", "16"],
                 "argument --head-dim: recipe 'qk_fp4_pv_fp4' needs a head dim that is a multiple "
                 "of 32, got 16", id="fp4-d16"),
    pytest.param(["--recipes", "qk_int8_pv_fp9"], "argument --recipes: unknown recipe",
                 id="recipe"),
    pytest.param(["--recipes", "qk_int8_pv_fp8:block_q=100"], "argument --recipes: Recipe.block_q",
                 id="recipe-option"),
    pytest.param(["--families", "nope"], "argument --families: unknown famil", id="family"),
    pytest.param(["--json", "/nonexistent-dir/rows.json"],
                 "argument --json: no directory '/nonexistent-dir'", id="json-missing-dir"),
    # an option another mode reads is refused rather than ignored (the prefix gives --n)
    pytest.param(["--gen-tokens", "8"], "argument --gen-tokens: only with --generation",
                 id="generation-option"),
    pytest.param(["--model", "minilm"], "argument --n: only for synthetic inputs, without --model",
                 id="synthetic-option-with-model"),
]


@pytest.mark.parametrize("argv,message", ACCURACY_USAGE_ERRORS)
def test_accuracy_usage_errors_stop_before_any_work(capsys, monkeypatch, argv, message):
    """One error line naming the option, and nothing evaluated."""
    from lowbit_attn.tools import accuracy

    monkeypatch.setattr(accuracy, "evaluate", _fail)
    line = usage_error(capsys, ["accuracy", "--n", "16", "--head-dim", "32", *argv])
    assert line.startswith("lowbit-attn accuracy: error: ") and message in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_accuracy_refuses_cuda_without_a_gpu(capsys, monkeypatch):
    from lowbit_attn.tools import accuracy

    monkeypatch.setattr(accuracy, "evaluate", _fail)
    line = usage_error(capsys, ["accuracy", "--device", "cuda"])
    assert "argument --device: 'cuda': CUDA is not available here" in line


# found by fuzzing the CLI (2026-11-29), each a traceback or unchecked before: the options, then
# what the error line says
FUZZED_BENCH_ERRORS = [(opts.split(), message) for opts, message in (
    case.split(" => ") for case in (
    "--batch 99999999999999999999 => argument --batch: must be between 1 and",
    "--seqlens 99999999999999999999k => argument --seqlens",
    "--out /dev/null => argument --out: '/dev/null' exists and is not a dir",
    "--out /proc/lowbit-nope => argument --out: cannot make the directory",
    "--host-arch abc --host => argument --host-arch: architecture must",
    "--baselines bogus => argument --baselines: expected some of",
    "--baselines none,flash => argument --baselines: expected some of",
))]


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--batch", "0"], "argument --batch: must be between 1 and", id="batch"),
    pytest.param(["--heads", "-1"], "argument --heads: must be between 1 and", id="heads"),
    pytest.param(["--dims", "64,0"], "argument --dims: must be between 1 and 256", id="dims"),
    pytest.param(["--seqlens", "0"], "argument --seqlens", id="seqlens"),
    pytest.param(["--rep", "nan"], "argument --rep: must be >= 0", id="rep-nan"),
    pytest.param(["--warmup", "-1"], "argument --warmup: must be >= 0", id="warmup"),
    pytest.param(["--min-cosine", "2"], "argument --min-cosine: must be between -1 and 1",
                 id="min-cosine"),
    pytest.param(["--time-budget", "x"], "argument --time-budget: expected float", id="budget"),
    pytest.param(["--recipes", ""], "argument --recipes: expected comma-separated names",
                 id="recipes-empty"),
    *FUZZED_BENCH_ERRORS,
])
def test_bench_usage_errors(capsys, monkeypatch, argv, message):
    from lowbit_attn.tools import bench

    monkeypatch.setattr(bench, "cli_main", _fail)
    line = usage_error(capsys, ["bench", *argv])
    assert line.startswith("lowbit-attn bench: error: ") and message in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_host_refuses_exact_without_a_gpu(capsys):
    """``exact`` has no kernel on a CPU: its stubbed host path would time PyTorch's maths."""
    assert cli.main(["bench", "--host", "--recipes", "exact"]) == 2
    assert "recipe 'exact' has no kernel on a CPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv,message", [
    (["--host-profile"], "--host-arch and --host-profile go with --host"),
    (["--host-arch", "sm_90"], "--host-arch and --host-profile go with --host"),
    (["--host", "--host-arch", "sm_86", "--recipes", "qk_int8_pv_fp8"],
     "needs FP8 tensor cores (compute capability 8.9 or newer), --host-arch sm_86 is 8.6"),
    (["--host", "--host-arch", "sm_75", "--recipes", "qk_int8_pv_fp16"],
     "compute capability 8.0 or newer, --host-arch sm_75 is 7.5"),
])
def test_bench_host_options_go_with_host_and_an_architecture_that_runs_the_recipe(
        capsys, argv, message):
    """Accepted and ignored before (exit 0): the host options without ``--host``, and a recipe
    the host architecture cannot run, timed as if it could."""
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_inspect_refuses_a_ptx_dir_it_cannot_make(capsys):
    line = usage_error(capsys, ["inspect", "--arch", "sm_90a", "--ptx-dir", "/dev/null"])
    assert "argument --ptx-dir: '/dev/null' exists and is not a directory" in line, line


def test_inspect_refuses_an_fp8_recipe_where_there_are_no_fp8_tensor_cores(capsys):
    line = usage_error(capsys, ["inspect", "--arch", "sm_80", "--recipe", "qk_int8_pv_fp8"])
    assert "needs FP8 tensor cores" in line and "qk_int8_pv_fp16" in line, line
    assert "--arch sm_80 is 8.0" in line, line  # the target, not a GPU: none is involved


def test_bench_refuses_a_head_dim_an_fp4_recipe_cannot_take(capsys):
    assert cli.main(["bench", "--recipes", "qk_fp4_pv_fp4", "--dims", "48"]) == 2
    assert "needs a head dim that is a multiple of 32, got 48" in capsys.readouterr().err


def test_arch_help_lists_every_aot_target():
    from lowbit_attn.tools import aot

    for arch in aot.ARCHS:
        assert arch in cli.ARCH_HELP


def _fake_module(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)

    def cli_main(args: argparse.Namespace) -> int:
        calls.append(args)
        return 0

    module.add_arguments = add_arguments
    module.cli_main = cli_main
    return module


@pytest.mark.parametrize("command,module", [("accuracy", "lowbit_attn.tools.accuracy"),
                                            ("bench", "lowbit_attn.tools.bench")])
def test_external_subcommands_get_their_modules_arguments(monkeypatch, command, module):
    calls: list = []
    monkeypatch.setitem(sys.modules, module, _fake_module(module, calls))
    assert cli.main([command, "--n", "7"]) == 0
    assert len(calls) == 1 and calls[0].n == 7 and calls[0].command == command


def test_missing_external_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lowbit_attn.tools.bench", None)  # import raises ImportError
    assert cli.main(["bench", "--n", "3"]) == 2
    err = capsys.readouterr().err
    assert "lowbit-attn bench: cannot import lowbit_attn.tools.bench" in err


@pytest.mark.triton_internals
def test_other_subcommands_do_not_import_external_modules(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lowbit_attn.tools.bench", None)
    monkeypatch.setitem(sys.modules, "lowbit_attn.tools.accuracy", None)
    code, _, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "exact")
    assert code == 0
