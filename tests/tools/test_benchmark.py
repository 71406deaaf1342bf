"""The benchmark module: its arithmetic, its CPU mode, its reports, and (on a GPU) a tiny run."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import script_module
from lowbit_attn.core.recipes import RECIPES
from lowbit_attn.tools.bench import (
    calls, command, flops, metadata, plots, protocol, run, save, tables,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tops_counts_four_bhn2d_and_halves_causal():
    # 4·B·H·N²·D = 4·4·32·1024²·128 = 68 719 476 736 operations in 1 ms → 68.72 TOP/s.
    assert flops.attention_ops(4, 32, 1024, 128, causal=False) == 68_719_476_736
    assert flops.tops(4, 32, 1024, 128, False, 1.0) == pytest.approx(68.719476736)
    assert flops.tops(4, 32, 1024, 128, True, 1.0) == pytest.approx(68.719476736 / 2)
    assert flops.tops(1, 1, 2, 1, False, 1e-9) == pytest.approx(16 / 1e-12 / 1e12)


def test_quantization_bytes_follow_the_passes_of_prepare():
    e = 1000
    fp8, fp16 = RECIPES["qk_int8_pv_fp8"], RECIPES["qk_int8_pv_fp16"]
    # fp8: K stats 2E + Q stats 2E + quantize Q 3E + quantize K 3E + V stats 2E + convert V 3E = 15E
    assert flops.quantization_bytes(fp8, e, e) == 15 * e
    # fp16 P·V: no V stats; V is rewritten as fp16 (2E read + 2E write) = 14E
    assert flops.quantization_bytes(fp16, e, e) == 14 * e
    assert flops.attention_bytes(fp8, e, e) == 5 * e
    assert flops.quantization_bytes(RECIPES["exact"], e, e) is None


@pytest.mark.parametrize(
    "text, expected",
    [("1k,2k", [1024, 2048]), ("256 4096", [256, 4096]), ("32K", [32768])],
    ids=["k-suffix", "spaces", "upper-K"],
)
def test_parse_seqlens(text, expected):
    assert command.parse_seqlens(text) == expected


def test_parse_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError):
        command.parse_seqlens("1m")
    with pytest.raises(argparse.ArgumentTypeError):
        command.parse_dims("64,x")
    with pytest.raises(argparse.ArgumentTypeError):
        command.parse_dims("64,300")
    with pytest.raises(argparse.ArgumentTypeError):
        command.parse_seqlens("0,1k")


def test_slug_of_gpu_name():
    assert save.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert save.slug("  ") == "unknown"


def test_select_methods_names_and_refuses_exact():
    keys = [m.key for m in protocol.select_methods()]
    assert keys[:3] == ["ours_fp8", "ours_fp8_bf16", "ours_fp16"]
    for k in (protocol.FLASH_KEY, protocol.CUDNN_KEY, "sdpa_cudnn_fp16", protocol.SAGE_KEY,
              "ours_fp8_prepare", "ours_fp8_attn"):
        assert k in keys
    assert [m.key for m in protocol.select_methods(baselines=[], bf16=False, breakdown=False)] == [
        "ours_fp8", "ours_fp16"]
    with pytest.raises(ValueError, match="exact"):
        protocol.select_methods(["exact"])
    with pytest.raises(ValueError, match="baseline"):
        protocol.select_methods(baselines=["xformers"])


def _check_row(row):
    assert set(protocol.ROW_FIELDS) <= set(row)
    assert row["status"] in protocol.STATUSES


def test_cpu_reference_run_returns_checked_rows():
    res = run.run_benchmark(
        dims=[32], seqlens=[64], causal_values=[False, True], batch=1, heads=2,
        methods=protocol.cpu_methods(), device="cpu", cpu_reps=1, mode="cpu-reference",
        progress=False,
    )
    rows = res["rows"]
    assert len(rows) == 2 * 3
    assert res["complete"]
    for row in rows:
        _check_row(row)
        assert row["status"] == "ok", row
        assert row["time_ms"] > 0 and row["tops"] > 0
        assert row["check"] == "pass"
        assert row["reference"] == "sdpa_math_fp32"
        assert row["peak_extra_mib"] is None  # no CUDA memory statistics on a CPU
    exact = [r for r in rows if r["recipe"] == "exact"]
    assert all(r["cosine"] > 0.99999 for r in exact)
    assert {r["recipe"] for r in rows} == {"qk_int8_pv_fp8", "qk_int8_pv_fp16", "exact"}


def test_gpu_loop_on_cpu_records_unsupported_backends():
    """The GPU method list on CPU tensors: our calls and SDPA flash run, cuDNN and SageAttention
    are recorded as unsupported with a reason instead of ending the run."""
    methods = protocol.select_methods(breakdown=False)
    res = run.run_benchmark(dims=[32], seqlens=[48], causal_values=[True], batch=1, heads=1,
                            methods=methods, device="cpu", cpu_reps=1, progress=False)
    by = {r["method"]: r for r in res["rows"]}
    for key in ("ours_fp8", "ours_fp8_bf16", "ours_fp16", protocol.FLASH_KEY):
        assert by[key]["status"] == "ok" and by[key]["check"] == "pass", by[key]
    for key in (protocol.CUDNN_KEY, protocol.SAGE_KEY):
        assert by[key]["status"] == "unsupported" and by[key]["reason"], by[key]


def test_a_failing_method_is_recorded_not_raised(monkeypatch):
    def broken(method, q, k, v, causal):
        def fn():
            return torch.full_like(q, float("nan"))
        import contextlib
        return fn, contextlib.nullcontext

    def raising(method, q, k, v, causal):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(calls.BUILDERS, "ours", broken)
    monkeypatch.setitem(calls.BUILDERS, "sage", raising)
    methods = [protocol.Method("ours_fp8", "ours", "ours", recipe="qk_int8_pv_fp8"),
               protocol.Method(protocol.SAGE_KEY, "sage", "sage")]
    res = run.run_benchmark(dims=[16], seqlens=[32], causal_values=[False], batch=1, heads=1,
                            methods=methods, device="cpu", cpu_reps=1, progress=False)
    ours, sage = res["rows"]
    assert ours["status"] == "ok" and ours["check"] == "FAIL" and ours["nonfinite"] == 32 * 16
    assert sage["status"] == "error" and "kernel exploded" in sage["reason"]
    assert command._failures(res) == [ours]
    assert "✗" in tables.render_markdown(res)
    assert "FAIL: ours_fp8" in tables.render_short_table(res)


def test_time_budget_skips_the_rest():
    res = run.run_benchmark(dims=[16], seqlens=[32, 64], causal_values=[False], batch=1, heads=1,
                            methods=protocol.cpu_methods(["qk_int8_pv_fp16"]), device="cpu",
                            cpu_reps=1, time_budget_s=0.0, progress=False)
    assert {r["status"] for r in res["rows"]} == {"skipped"}
    assert "time budget" in res["rows"][0]["reason"]


def _synthetic_results():
    """A GPU-shaped results dict with numbers from DESIGN.md (no GPU involved)."""
    meta = {
        "schema": 1, "mode": "gpu", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
        "capability": [9, 0], "arch": "sm_90a", "date": "2026-11-22",
        "date_utc": "2026-11-22T12:00:00+00:00", "hostname": "gpu-1",
        "command": "lowbit-attn bench",
        "versions": {"torch": "2.11.0", "triton": "3.6.0", "lowbit_attn": "0.1.0"},
        "protocol": {"B": 4, "H": 32},
    }
    rows = []

    def row(method, label, kind, n, causal, tops=None, status="ok", check="pass", reason=None,
            dtype="fp16"):
        r = dict.fromkeys(protocol.ROW_FIELDS)
        ops = flops.attention_ops(4, 32, n, 128, causal)
        r.update(method=method, label=label, kind=kind, dtype=dtype, B=4, H=32, N=n, D=128,
                 causal=causal, status=status, reason=reason)
        if status == "ok":
            r.update(tops=tops, time_ms=ops / (tops * 1e12) * 1e3, check=check, cosine=0.9993,
                     nonfinite=0, rel_l1=0.03, peak_extra_mib=512.0, reference="sdpa_flash_fp16")
        rows.append(r)

    for n, ours, cudnn, flash, sage in ((1024, 300, 554, 318, 225), (16384, 785, 628, 345, 459)):
        row("ours_fp8", "ours qk_int8_pv_fp8", "ours", n, False, ours,
            check="FAIL" if n == 1024 else "pass")
        row(protocol.CUDNN_KEY, "SDPA cuDNN bf16", "sdpa", n, False, cudnn, dtype="bf16")
        row(protocol.FLASH_KEY, "SDPA flash fp16", "sdpa", n, False, flash)
        if n == 1024:
            row(protocol.SAGE_KEY, "SageAttention 1.0.6 fp16", "sage", n, False, sage)
        else:
            row(protocol.SAGE_KEY, "SageAttention 1.0.6 fp16", "sage", n, False, status="oom",
                reason="OutOfMemoryError: CUDA out of memory")
    return {"metadata": meta, "rows": rows, "complete": True}


def test_markdown_renders_tops_speedups_failures_and_skips():
    md = tables.render_markdown(_synthetic_results())
    assert "NVIDIA H100 80GB HBM3 (sm_90a)" in md
    assert "| 128 | no | 16k | 785 | 628 | 345 | oom |" in md
    assert "| 128 | no | 1k | 300 ✗ | 554 | 318 | 225 |" in md
    assert "1.25×" in md  # 785 / 628 at 16k
    assert "≥ 1.25×" in md and "≥ 1.00×" in md  # the targets
    assert "**check failed**" in md
    assert "**oom** — OutOfMemoryError" in md
    short = tables.render_short_table(_synthetic_results())
    assert "0.54× ✗" not in short  # the short table shows the speedup and flags the check apart
    assert "≥1.25 met" in short and "≥1.00 MISSED" in short
    assert short.splitlines()[0].startswith("| D | causal | N | ours fp8 |")


def test_write_results_names_files_by_gpu_and_date(tmp_path):
    paths = save.write_results(_synthetic_results(), tmp_path, plot=False)
    assert [p.name for p in paths] == ["nvidia-h100-80gb-hbm3-2026-11-22.json",
                                       "nvidia-h100-80gb-hbm3-2026-11-22.md"]
    back = json.loads(paths[0].read_text())
    assert back["metadata"]["device_name"] == "NVIDIA H100 80GB HBM3"
    assert len(back["rows"]) == 8  # 2 configurations × 4 methods


def test_plot_draws_from_the_data(tmp_path):
    pytest.importorskip("matplotlib")
    path = plots.plot_results(_synthetic_results(), tmp_path / "chart.png")
    assert path.is_file() and path.stat().st_size > 1000


def test_metadata_names_the_device():
    meta = metadata.make_metadata(device="cpu", mode="cpu-reference", protocol={}, argv=["bench"])
    assert meta["device"] == "cpu" and meta["device_name"].startswith("CPU")
    assert meta["command"] == "bench"
    for key in ("date_utc", "date", "hostname", "versions", "capability", "backend"):
        assert key in meta
    assert {"torch", "triton", "lowbit_attn"} <= set(meta["versions"])
    json.dumps(meta)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode of `bench` runs without CUDA")
def test_cli_on_cpu_writes_files_only_with_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parser = command.add_arguments(argparse.ArgumentParser())
    assert command.cli_main(parser.parse_args(["--causal", "no", "--no-plot"])) == 0
    captured = capsys.readouterr()
    assert "NOT kernel benchmarks" in captured.err
    assert captured.out.strip().splitlines()[-1].startswith("| 64 | no | 256 |")
    assert not (tmp_path / "benchmarks").exists()
    assert list(tmp_path.iterdir()) == []

    out = tmp_path / "res"
    assert command.cli_main(
        parser.parse_args(["--causal", "yes", "--no-plot", "--out", str(out)])) == 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 2 and files[0].startswith("cpu-reference-") and files[0].endswith(".json")
    meta = json.loads((out / files[0]).read_text())["metadata"]
    assert meta["device"] == "cpu" and meta["mode"] == "cpu-reference"


def test_cli_rejects_unknown_recipe(capsys):
    parser = command.add_arguments(argparse.ArgumentParser())
    assert command.cli_main(parser.parse_args(["--recipes", "qk_int4"])) == 2
    assert "unknown recipe" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_smoke_run_checks_and_times_every_method():
    """A tiny version of the full benchmark: every method runs or says why it cannot, and our
    recipes pass the accuracy check against SDPA."""
    # heads=16: the same integer specialisations (multiples of 16) as the full run, which then
    # finds these kernels in Triton's cache.
    res = run.run_benchmark(dims=[64, 128], seqlens=[256], causal_values=[False, True], batch=1,
                            heads=16, methods=protocol.select_methods(), device="cuda",
                            warmup_ms=1, rep_ms=3, progress=False)
    assert res["metadata"]["device_name"] == torch.cuda.get_device_name()
    for row in res["rows"]:
        _check_row(row)
        if row["kind"] != "sage":  # a baseline's own failure is recorded, not ours to fail on
            assert row["status"] != "error", row
        if row["kind"] in ("ours", "stage"):
            assert row["status"] == "ok", row
            assert row["time_ms"] > 0
            if row["check"] is not None:
                assert row["check"] == "pass", row
        if row["kind"] == "ours":
            assert row["peak_extra_mib"] is not None
    flash = [r for r in res["rows"] if r["method"] == protocol.FLASH_KEY]
    assert all(r["status"] == "ok" for r in flash)


def test_cli_gpu_path_writes_every_out_dir(tmp_path, monkeypatch, capsys):
    """The GPU branch of `bench` with the run itself stubbed: options reach run_benchmark, partial
    and final results land in every --out directory, the short table is printed last, and a failed
    check of ours gives exit status 1."""
    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)
        res = _synthetic_results()
        res["complete"] = False
        kwargs["on_config_done"](res)  # a partial save, as after each configuration
        res["complete"] = True
        return res

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(command, "run_benchmark", fake_run)
    parser = command.add_arguments(argparse.ArgumentParser())
    a, b = tmp_path / "a", tmp_path / "b"
    args = parser.parse_args(["--quick", "--causal", "no", "--no-plot", "--out", str(a), "--out",
                              str(b), "--time-budget", "100", "--baselines", "cudnn,flash"])
    assert command.cli_main(args) == 1  # the synthetic ours row at 1k failed its check
    assert (seen["dims"] == list(protocol.QUICK_DIMS)
            and seen["seqlens"] == list(protocol.QUICK_SEQLENS))
    assert seen["causal_values"] == [False] and seen["time_budget_s"] == 100
    assert seen["device"] == "cuda"
    assert [m.key for m in seen["methods"] if m.kind != "stage"] == [
        "ours_fp8", "ours_fp8_bf16", "ours_fp16", protocol.FLASH_KEY, protocol.CUDNN_KEY,
        "sdpa_cudnn_fp16"]
    for d in (a, b):
        names = sorted(p.name for p in d.iterdir())
        assert names == ["nvidia-h100-80gb-hbm3-2026-11-22-quick.json",
                         "nvidia-h100-80gb-hbm3-2026-11-22-quick.md"]
        saved = json.loads((d / names[0]).read_text())
        assert saved["complete"] and saved["metadata"]["quick"]
    out = capsys.readouterr()
    assert out.out.strip().splitlines()[-1].startswith("| 128 | no | 16k |")
    assert "FAILED ours_fp8 D=128 N=1024" in out.err


def test_default_results_dir_is_in_the_checkout():
    d = command.default_results_dir()
    assert d.parts[-2:] == ("benchmarks", "results")
    assert d.parent.parent == metadata.checkout_root()


def test_an_installed_package_records_no_commit_of_the_repository_around_it(tmp_path,
                                                                             monkeypatch):
    """A virtual environment inside another project's checkout (``./.venv``): its commit is not
    the package's revision."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=x", "-c", "user.email=x@x",
                    "commit", "-q", "--allow-empty", "-m", "other project"], check=True)
    installed = tmp_path / ".venv/lib/python3.11/site-packages/lowbit_attn/tools/bench"
    installed.mkdir(parents=True)
    monkeypatch.setattr(metadata, "__file__", str(installed / "metadata.py"))
    assert metadata.checkout_root() is None and metadata._git_revision() is None
    assert command.default_results_dir() == Path("benchmarks") / "results"


def test_fp4_recipes_get_their_own_keys_and_stage_rows():
    keys = [m.key for m in protocol.select_methods(["qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4"], [],
                                                   bf16=True)]
    assert keys == ["ours_nvfp4", "ours_mxfp4", "ours_nvfp4_prepare", "ours_nvfp4_attn",
                    "ours_mxfp4_prepare", "ours_mxfp4_attn"]


def test_training_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/bench_train.py end to end on the CPU reference (tiny size): JSON, table, checks."""
    bench = script_module("benchmarks/bench_train.py")
    assert bench.main(["--quick", "--methods", "sagebwd_int8,ours_exact_16bit", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("train-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {r["method"] for r in rows} == {"sagebwd_int8", "ours_exact_16bit"}
    for r in rows:
        assert r["status"] == "ok" and r["cosine"]["dq"] > 0.998, r


def test_training_benchmark_keeps_to_its_time_budget(tmp_path):
    """``--time-budget``: configurations not started by then are rows ``skipped: time budget``,
    saved like the rest (the file is rewritten after every configuration)."""
    bench = script_module("benchmarks/bench_train.py")
    assert bench.main(["--quick", "--causal", "no", "--methods", "sagebwd_int8",
                       "--time-budget", "0", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("train-*.json")
    data = json.loads(result.read_text())
    assert data["complete"] is True
    assert [(r["method"], r["status"], r["causal"]) for r in data["rows"]] == [
        ("*", "skipped: time budget", False)]


def test_vsa_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/bench_vsa.py end to end on the PyTorch path (tiny grid): JSON and table."""
    bench = script_module("benchmarks/bench_vsa.py")
    assert bench.main(["--sparsities", "0.75", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("vsa-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {r["method"] for r in rows} >= {"vsa", "vsa_fine_only", "sdpa_cudnn_dense",
                                           "vsa_fine_only[qk_int8_pv_fp8]"}
    assert all(r["status"] == "ok" for r in rows)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_benchmark_runs_on_cpu(tmp_path, monkeypatch, backend):
    """benchmarks/bench_decode.py end to end at its CPU size: the SDPA fp16 row and the 8-bit
    cache's (the reference, or the split-KV kernel on the interpreter), bytes below the fp16
    cache's, the cosine against float64 at the recipe's level."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    bench = script_module("benchmarks/bench_decode.py")
    assert bench.main(["--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("decode-*.json")
    rows = {r["method"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"sdpa_fp16", "kv_int8_fp8", "sdpa_fp16+write", "kv_int8_fp8+append"}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["kv_int8_fp8+append"]["cosine"] > 0.999  # the step's first call: all n tokens
    assert rows["kv_int8_fp8"]["bytes"] < 0.6 * rows["sdpa_fp16"]["bytes"]
    assert rows["sdpa_fp16"]["cosine"] > 0.99999 and rows["kv_int8_fp8"]["cosine"] > 0.999
    assert all(r["host_us"] > 0 and r["loop_ms"] > 0 for r in rows.values())
    table = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "| 200 | 2 | 2:1 | kv_int8_fp8 |" in table
    # the table names what produced it: the device, the date and the command
    meta = json.loads(result.read_text())
    assert table.startswith(f"decode on {meta['device_name']}, {meta['date_utc']}")
    assert f"Command: `{meta['command']}`" in table


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_benchmark_times_a_sliding_window_layer_on_cpu(tmp_path, monkeypatch, backend):
    """``--window``: at its CPU size (N = 200, window 64) the sliding-window layer's row and the
    full layer of the 65 tokens it sees, both against exact attention over those tokens; the
    window layer keeps its window, not the 200 tokens."""
    import json

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    bench = script_module("benchmarks/bench_decode.py")
    assert bench.main(["--out", str(tmp_path), "--window", "4096"]) == 0
    (result,) = tmp_path.glob("decode-*.json")
    rows = {r["method"]: r for r in json.loads(result.read_text())["rows"]}
    window, last = rows["kv_int8_fp8 window 64"], rows["kv_int8_fp8 last 65"]
    assert window["status"] == "ok" and last["status"] == "ok"
    assert window["cosine"] > 0.999 and last["cosine"] > 0.999
    assert window["bytes"] == last["bytes"] < rows["kv_int8_fp8"]["bytes"]
    assert window["cache_nbytes"] < 0.8 * rows["kv_int8_fp8"]["cache_nbytes"]


def test_decode_benchmark_keeps_each_row_and_survives_an_error_outside_a_row(tmp_path):
    """A configuration that raises between rows (here the window layer's set-up) keeps the rows
    it measured, saved as they came, gets an error row naming the exception, and the run goes
    on; the exit status says a row failed."""
    import json

    bench = script_module("benchmarks/bench_decode.py")
    saved = []

    def broken(record, *args):
        saved.append(json.loads(next(tmp_path.glob("decode-*.json")).read_text())["rows"])
        raise RuntimeError("no window today")

    bench.window_rows = broken
    assert bench.main(["--out", str(tmp_path), "--window", "4096"]) == 1
    assert [r["method"] for r in saved[0]] == ["sdpa_fp16", "kv_int8_fp8"]  # saved row by row
    rows = json.loads(next(tmp_path.glob("decode-*.json")).read_text())["rows"]
    assert [r["method"] for r in rows] == ["sdpa_fp16", "kv_int8_fp8", "*"]
    assert rows[-1]["status"] == "error outside a row: RuntimeError: no window today"


def test_benchmarks_wait_a_bounded_time_for_admission_and_record_the_verdict(monkeypatch):
    from lowbit_attn.inference import gluon_check
    from lowbit_attn.tools.bench import calls

    asked = []
    monkeypatch.setattr(gluon_check, "wait_for_admission", lambda timeout=None: asked.append(
        timeout) or {"_attn_fwd_sm90_kernel@0": gluon_check.RUNNING, "_dkdv@0": None})
    row = {}
    calls.await_admission(row)
    assert asked == [calls.ADMISSION_WAIT_S] and 0 < calls.ADMISSION_WAIT_S <= 90
    assert row["admission"] == {"_attn_fwd_sm90_kernel@0": gluon_check.RUNNING,
                                "_dkdv@0": "admitted"} and row["admission_wait_s"] >= 0


def test_hopper_benchmark_runs_every_variant_on_the_interpreter(tmp_path, monkeypatch):
    """benchmarks/bench_hopper.py end to end on the Triton interpreter (tiny size): every row
    checked against the reference, the forced kernel candidates (plain and pipelined) included."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    bench = script_module("benchmarks/bench_hopper.py")
    assert bench.main(["--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("hopper-*.json")
    rows = json.loads(result.read_text())["rows"]
    methods = {r["method"] for r in rows}
    assert methods >= {"sdpa_cudnn_bf16", "ours", "ours block_k=128", "prepare",
                       "attention", "ours cfg=4w1s-plain", "ours cfg=4w1s-pipelined"}
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["cosine"] > 0.998 for r in rows if not r["method"].startswith("prepare"))
    assert not any("gluon" in m for m in methods)  # bench_forward.py times the Gluon forward
    table = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "| method | × cuDNN | bar | met |" in table
    with pytest.raises(SystemExit):  # no --gluon rows: the forward they timed is deleted
        bench.main(["--gluon", "--out", str(tmp_path)])


@pytest.mark.triton_internals
def test_forward_benchmark_runs_on_the_interpreter_without_the_gluon_kernels(tmp_path,
                                                                            monkeypatch):
    """``benchmarks/bench_forward.py`` (issue 36's sweep) on the interpreter (tiny size): the SDPA
    and Triton rows run and pass their check against exact attention; ``LOWBIT_ATTN_KERNEL=sm90``
    runs the Triton kernel (the one-warpgroup kernel never checked on a CPU); the sm90
    kernel-alone rows are skipped with the reason; JSON and markdown are written."""
    import sys

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_hopper's helpers
    bench = script_module("benchmarks/bench_forward.py")
    assert bench.main(["--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("forward-*.json")
    data = json.loads(result.read_text())
    assert data["complete"] is True
    rows = {r["method"]: r for r in data["rows"] if not r["causal"]}
    for name in ("sdpa cudnn", "sdpa flash", "e2e triton token", "tuned triton token",
                 "e2e sm90 thread",
                 "e2e sm90 token", "kernel triton token", "kernel triton thread",
                 "e2e triton thread", "prepare permuted"):
        assert rows[name]["status"] == "ok", (name, rows[name])
    for name in ("e2e sm90 thread", "e2e sm90 token"):
        assert rows[name]["note"] == "not checked" and rows[name]["check"] == "pass"
    skipped = [r for r in rows.values() if r["method"].startswith("kernel sm90")]
    assert len(skipped) == 8 and all(r["status"] == "skipped" for r in skipped)
    assert not any("gluon" in name for name in rows)
    table = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "| 64 | 160 | no | 1×2 | e2e sm90 thread |" in table
    assert "| D | N | causal | best sm90 e2e | × cuDNN | bar | met | × SageAttention |" in table
    sys.modules.pop("bench_hopper", None)


def test_forward_benchmark_decide_runs_the_decisive_rows_with_the_bars(tmp_path, monkeypatch):
    """``bench_forward.py --decide`` (run_on_gpu.sh decide) on the interpreter: only the rows that
    decide, each with its first call's time; issue 43's bars in the JSON and the table."""
    import sys

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = script_module("benchmarks/bench_forward.py")
    # each bar's first configuration before any bar's second (a run cut short keeps every bar)
    assert bench.DECIDE_CONFIGS[:5] == [(128, 16384, False), (128, 1024, False),
                                        (64, 16384, False), (64, 1024, False), (128, 16384, True)]
    assert bench.BATCH_HEADS[1024] == (16, 32)
    assert bench.DECIDE_FIRST == 5  # the candidates' passes come next, before the second ones
    assert bench.main(["--decide", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("forward-*.json")
    data = json.loads(result.read_text())
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    assert methods == list(bench.DECIDE_ROWS)
    # last: launch plans (not in the bars), issue 44's windows, then a pass of the kernel's
    # variants alone (at the kernel bar's configuration on a GPU), then the window on the sm90
    # kernel alone, the Triton kernel's trial candidate and the windowed call autotuned (at the
    # causal one)
    assert methods[-13:] == ["e2e sm90 thread plan", "e2e sm90 thread win512",
                             "e2e triton thread win512", "e2e triton token win512",
                             "kernel triton token causal", "kernel triton token win512",
                             "kernel sm90 thread k2", "kernel sm90 thread r168",
                             "kernel sm90 token r168", "kernel sm90 thread win512",
                             "kernel triton token causal m64", "kernel triton token win512 m64",
                             "tuned triton token win512"]
    assert [r["method"] for r in data["rows"][-5:]] == ["kernel sm90 thread win512",
                                                          "kernel sm90 thread r168",
                                                          "kernel triton token causal m64",
                                                          "kernel triton token win512 m64",
                                                          "tuned triton token win512"]
    trial = {r["method"]: r for r in data["rows"][-3:-1]}
    # the trial candidate ran (on the interpreter, its meta-parameters) and was checked
    assert all(r["status"] == "ok" and "M_SPLIT: 2" in r["note"] for r in trial.values()), trial
    assert "cosine" in trial["kernel triton token causal m64"]
    assert data["rows"][-1]["causal"] and "LOWBIT_ATTN_AUTOTUNE=all" in data["rows"][-1]["note"]
    assert bench.DECIDE_VARIANTS == (128, 16384, False)
    assert bench.DECIDE_WINDOW_TUNED == bench.DECIDE_CAUSAL_VARIANTS == (128, 16384, True)
    ran = [r for r in data["rows"] if r["status"] == "ok"]
    assert ran and all(r["first_call_s"] > 0 for r in ran)
    windowed = [r for r in data["rows"] if r["method"].endswith("win512")]
    assert windowed and all(r["status"] == "ok" for r in windowed
                            if not r["method"].startswith("kernel sm90")), windowed
    bars = {b["bar"]: b for b in data["bars"]}
    assert bars["kernel alone TOP/s, D=128 N=16k"]["target"] == 850.0
    assert bars["e2e sm90 cosine (worst)"]["target"] == 0.9992
    first = bars["first call of a new shape, s (slowest e2e row)"]
    assert first["target"] == 2.0 and first["value"] > 0
    table = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "| bar (issues 43, 44) | value | target | met |" in table and "first call s" in table
    # on the interpreter the window rows ran (the sm90 ones are skipped): the bars say so
    assert bars["window 512 x full causal, e2e triton token, D=128 N=16k (issue 44)"]["target"] \
        == 8.0
    assert bars["admitted e2e sm90 x e2e triton token (worst configuration)"]["value"] is None
    sys.modules.pop("bench_hopper", None)


def test_forward_bars_decide_the_sm90_default_and_the_window(monkeypatch):
    """The decision rows of ``bench_forward.bars``: the admitted sm90 forward's best e2e row
    against the default path's, worst over configurations (rows not admitted do not count);
    issue 44's window end to end and kernels alone at D=128 N=16k causal."""
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = script_module("benchmarks/bench_forward.py")

    def row(d, n, causal, method, ms, note=None):
        return {"D": d, "N": n, "causal": causal, "method": method, "ms": ms, "status": "ok",
                "note": note, "tops": 1.0}

    rows = [row(128, 16384, False, "e2e sm90 thread", 8.0, "admitted"),
            row(128, 16384, False, "e2e sm90 token", 9.0, "admitted"),
            row(128, 16384, False, "e2e triton token", 10.0),
            row(128, 1024, False, "e2e sm90 thread", 1.2, "admitted"),
            row(128, 1024, False, "e2e triton token", 1.0),
            row(64, 1024, False, "e2e sm90 thread", 0.5, "its check failed"),
            row(64, 1024, False, "e2e triton token", 1.0),
            row(128, 16384, True, "e2e triton token", 9.0),
            row(128, 16384, True, "e2e triton token win512", 3.0),
            row(128, 16384, True, "kernel triton token causal", 8.0),
            row(128, 16384, True, "kernel triton token win512", 1.0),
            row(128, 16384, True, "kernel sm90 thread", 6.0),
            row(128, 16384, True, "kernel triton token causal m64", 6.4),
            row(128, 16384, True, "kernel triton token win512 m64", 0.8)]
    found = {b["bar"]: b for b in bench.bars(rows)}
    sm90 = found["admitted e2e sm90 x e2e triton token (worst configuration)"]
    assert abs(sm90["value"] - 1.0 / 1.2) < 1e-12 and sm90["met"] is False  # 1k loses
    windows = [(v["value"], v["met"]) for k, v in found.items() if k.startswith("window")]
    # e2e, Triton, sm90 (no row), Triton's trial against the faster full causal (its own)
    assert windows == [(3.0, False), (8.0, True), (None, None), (8.0, True)]
    sys.modules.pop("bench_hopper", None)
