"""The ``lowbit-attn`` command: ``doctor``, ``inspect`` (AOT), and the wiring of ``accuracy`` and
``bench`` to their modules."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from lowbit_attn import cli
from lowbit_attn.recipes import RECIPES, get_recipe


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
def test_inspect_failing_kernel_exits_1_and_says_why(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_80", "--recipe", "qk_int8_pv_fp8")
    assert code == 1
    assert "error" in out and "fp8e4nv" in out


def test_inspect_exact_launches_nothing(capsys):
    code, out, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "exact")
    assert code == 0
    assert "launches no Triton kernel" in out


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "--arch", "sm_70", "--recipe", "qk_int8_pv_fp8"], "argument --arch"),
    (["inspect", "--arch", "hopper"], "sm_90a"),
    (["inspect", "--recipe", "qk_int8_pv_fp8"], "--arch"),
    (["inspect", "--arch", "sm_90a", "--recipe", "int4"], "argument --recipe"),
    (["inspect", "--arch", "sm_90a", "--head-dim", "512"], "head_dim"),
    ([], "COMMAND"),
])
def test_usage_errors_exit_2_with_a_clear_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_arch_help_lists_every_aot_target():
    from lowbit_attn import aot

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


@pytest.mark.parametrize("command,module", [("accuracy", "lowbit_attn.accuracy"),
                                            ("bench", "lowbit_attn.benchmark")])
def test_external_subcommands_get_their_modules_arguments(monkeypatch, command, module):
    calls: list = []
    monkeypatch.setitem(sys.modules, module, _fake_module(module, calls))
    assert cli.main([command, "--n", "7"]) == 0
    assert len(calls) == 1 and calls[0].n == 7 and calls[0].command == command


def test_missing_external_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lowbit_attn.benchmark", None)  # import raises ImportError
    assert cli.main(["bench", "--n", "3"]) == 2
    err = capsys.readouterr().err
    assert "lowbit-attn bench: cannot import lowbit_attn.benchmark" in err


def test_other_subcommands_do_not_import_external_modules(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lowbit_attn.benchmark", None)
    monkeypatch.setitem(sys.modules, "lowbit_attn.accuracy", None)
    code, _, _ = run(capsys, "inspect", "--arch", "sm_90a", "--recipe", "exact")
    assert code == 0
