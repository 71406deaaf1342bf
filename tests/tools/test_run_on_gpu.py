"""``benchmarks/run_on_gpu.sh``'s ``decide`` and ``decide2`` stages on a CPU (issue 43), with a
stand-in for Python (``PYTHON=``): every command the stage runs is recorded instead of run (the
benchmarks write a stand-in result into each ``--out``), except the stage's own summary, which
runs for real. What is checked: the order of the steps (what decides defaults first: the sm90
forward's tests in ``decide``, the launch plans' tests, with ``LOWBIT_ATTN_LAUNCH=plan``, last
in ``decide2``; the decisive rows first), that every step ends within the stage's
budget, that ``$OUT`` gets at most 8 files, that the summary names the device, date and command,
records each step and carries issue 43's bars, and that a budget too small for the later steps
skips them and still leaves the files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import script_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_on_gpu.sh"

STUB = f"""#!{sys.executable}
import json, os, runpy, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({{"args": args, "launch": os.environ.get("LOWBIT_ATTN_LAUNCH")}}) + "\\n")
if args and args[0].endswith("stage_summary.py"):
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
    sys.exit(0)
if args[:1] == ["-c"] or args[:1] == ["-"]:
    sys.exit(1)  # no CUDA, no xdist, no sageattention
kinds = {{"bench_forward.py": "forward", "bench_train.py": "train", "bench_vsa.py": "vsa",
         "bench_decode.py": "decode"}}
kind = kinds.get(Path(args[0]).name) if args else None
if kind == "decode" and "--splits" in args:
    kind = "splits"
if args and Path(args[0]).name == "prep_speed.py":  # its own file, named by the script
    Path(args[1]).write_text(json.dumps({{"device": "stub GPU", "rows": []}}))
    Path(args[1]).with_suffix(".md").write_text("prep table\\n")
if args and Path(args[0]).name == "first_call.py":  # into the folder it is given
    row = {{"d": 128, "mode": "parallel", "status": "ok", "first_call_s": 1.5}}
    stem = Path(args[1]) / "first-stub-gpu-2026-11-28"
    stem.with_suffix(".json").write_text(json.dumps({{"device_name": "stub GPU", "rows": [row]}}))
    stem.with_suffix(".md").write_text("first-call table\\n")
if kind:
    outs = [args[i + 1] for i, a in enumerate(args) if a == "--out"]
    rows = {{"forward": [], "train": [
        {{"method": "sdpa_flash", "d": 128, "n": 8192, "causal": False, "status": "ok", "ms": 2.0}},
        {{"method": "sagebwd_int8", "d": 128, "n": 8192, "causal": False, "status": "ok",
         "ms": 2.5}}],
        "vsa": [], "decode": [
        {{"N": 8192, "batch": 1, "gqa": "4:1", "method": "sdpa_fp16", "status": "ok", "ms": 1.0}},
        {{"N": 8192, "batch": 1, "gqa": "4:1", "method": "kv_int8_fp8", "status": "ok",
         "ms": 0.5}}],
        "splits": [
        {{"N": 8192, "batch": 1, "gqa": "4:1", "method": "sdpa_fp16", "status": "ok", "ms": 1.0}},
        {{"N": 8192, "batch": 1, "gqa": "4:1", "method": "kv_int8_fp8 split 2", "status": "ok",
         "ms": 0.5, "split_label": "128 keys per split", "production": False}},
        {{"N": 8192, "batch": 1, "gqa": "4:1", "method": "kv_int8_fp8 split 8", "status": "ok",
         "ms": 2.0, "split_label": "512 keys per split", "production": True}}]}}[kind]
    bars = [{{"bar": "kernel alone TOP/s, D=128 N=16k", "value": None, "target": 850.0,
             "met": None}}] if kind == "forward" else []
    for out in outs:
        Path(out).mkdir(parents=True, exist_ok=True)
        data = {{"device_name": "stub GPU", "rows": rows, "bars": bars, "complete": True}}
        (Path(out) / f"{{kind}}-stub-gpu-2026-11-28.json").write_text(json.dumps(data))
        (Path(out) / f"{{kind}}-stub-gpu-2026-11-28.md").write_text(f"{{kind}} table\\n")
"""


def run_stage(tmp_path: Path, stage: str, budget: int | None = None) -> tuple[int, Path, list]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_ATTN_", "TOTAL_"))}
    env.update(PYTHON=str(stub), OUT=str(out), STUB_LOG=str(tmp_path / "calls.jsonl"))
    if budget is not None:
        env["TOTAL_BUDGET"] = str(budget)
    done = subprocess.run(["bash", str(SCRIPT), stage], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return done.returncode, out, calls, done


def _commands(calls) -> list[dict]:
    """The stage's steps as the stand-in saw them (not its probes of the environment, its
    installs of the wheels a checkout may hold in ``wheels/``, or the summary)."""
    return [c for c in calls if c["args"][:1] not in (["-c"], ["-"])
            and c["args"][:2] != ["-m", "pip"] and not c["args"][0].endswith("stage_summary.py")]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gluon_is_no_stage(tmp_path):
    """The ``gluon`` stage went with the Hopper forward it timed: ``gluon`` runs no tests and no
    benchmark (the sm90 forward's are in the ``forward`` and ``decide`` stages)."""
    rc, out, calls, done = run_stage(tmp_path, "gluon")
    assert rc == 0, done.stderr[-3000:]
    assert _commands(calls) == []


@pytest.mark.parametrize("stage,budget", [("decide", 470), ("decide2", 470)])
def test_a_stage_runs_its_steps_in_order_within_its_budget(tmp_path, stage, budget):
    rc, out, calls, done = run_stage(tmp_path, stage)
    assert rc == 0, done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    for log in (f"{stage}.log", f"pytest-{stage}.log"):  # each names device, date and command
        first = (out / log).read_text().splitlines()[0]
        assert first.startswith("# ") and f"command: bash benchmarks/run_on_gpu.sh {stage}" in first
    summary = json.loads((out / f"{stage}.json").read_text())
    assert summary["command"].startswith(f"bash benchmarks/run_on_gpu.sh {stage}")
    assert summary["date_utc"] and summary["device"] == "stub GPU"
    steps = summary["steps"]
    for s in steps:  # every step ends within the budget
        assert s["exit"] == "0", s
        assert int(s["started_s"]) + int(s["limit_s"]) <= budget, s
    commands = _commands(calls)
    text = [shlex.join(c["args"]) for c in commands]
    if stage == "decide":
        assert [s["step"] for s in steps] == ["sm90-forward-tests", "sm90-forward-admission",
                                             "prep", "forward-sweep"]
        assert "-k" in commands[0]["args"] and "sm90" in text[0]
        assert "admission_time.py fwd" in text[1]
        assert "prep_speed.py" in text[2] and "prep" in summary["results"]  # embedded
        assert "bench_forward.py --decide" in text[3] and "--time-budget" in text[3]
        assert any(name.startswith("forward-") for name in files)
        assert any(b["bar"].startswith("kernel alone") for b in summary["bars"])
    else:
        assert [s["step"] for s in steps] == ["sm90-backward-tests", "sm90-backward-admission",
                                             "train", "train-probe", "decode", "decode-splits",
                                             "first-call", "plan-tests"]
        assert "--splits 1,2,4,8,16 --parts 32,64,128" in text[5] and "--batches 1,16" in text[5]
        assert "first_call.py" in text[6] and "--modes parallel --caches cold,warm" in text[6]
        assert "tests/test_gpu_plans.py" in text[7] and commands[7]["launch"] == "plan"
        assert "sm90_backward" in text[0] and "admission_time.py bwd" in text[1]
        assert "bench_train.py --dims 128" in text[2] and "sdpa_flash" in text[2]
        assert "bench_decode.py --seqlens 32k,8k --batches 1 " in text[4]
        assert "--window 4096" in text[4]
        bars = {b["bar"]: b for b in summary["bars"]}
        train = bars["training sagebwd_int8 x SDPA flash, D=128 N>=4k (worst)"]
        assert train["value"] == pytest.approx(0.8) and train["met"] is False
        decode = bars["decode batch 1 N=8k x SDPA (worst GQA)"]
        assert decode["value"] == pytest.approx(2.0) and decode["met"] is True
        first = bars["first call of a new shape, cold Triton cache, D=128, "
                     "LOWBIT_ATTN_COMPILE=parallel, s"]
        assert first["value"] == pytest.approx(1.5) and first["met"] is True
        split = bars["decode split, N=8k batch 1 GQA 4:1: fastest, 128 keys per split, ms, 4.00x "
                     "production, 2.00x SDPA"]
        assert split["value"] == pytest.approx(0.5)
        assert "decode split fastest on every row: 128 keys per split" in bars
        assert "train_speed.py --quick" in text[3]
        assert set(summary["results"]) == {"train", "decode", "splits", "first"}
    table = (out / f"{stage}.md").read_text()
    assert "| bar (issues 43, 44) | value | target | met |" in table and "stub GPU" in table
    assert not any(p.name.startswith("stub") for p in (ROOT / "benchmarks" / "results").iterdir())


def test_a_budget_too_small_skips_the_later_steps_and_still_leaves_the_files(tmp_path):
    rc, out, calls, done = run_stage(tmp_path, "decide", budget=280)
    assert rc == 0, done.stderr[-3000:]
    steps = json.loads((out / "decide.json").read_text())["steps"]
    assert steps[0]["exit"] == "skipped"  # 150 s cap, 270 s kept for the rest: under 20 s left
    assert all(int(s["started_s"]) + int(s["limit_s"]) <= 280 for s in steps)
    assert steps[-1]["step"] == "forward-sweep" and steps[-1]["exit"] == "0"
    assert (out / "decide.md").exists() and len(list(out.iterdir())) <= 8


def test_decide2_skips_the_backward_tests_rather_than_cut_them_short(tmp_path):
    """With 380 s (the H200's decide2 of 2026-11-29), the backward's GPU tests would get 40 s of
    the 70 they need: skipped, and every later step runs."""
    rc, out, calls, done = run_stage(tmp_path, "decide2", budget=380)
    assert rc == 0, done.stderr[-3000:]
    steps = json.loads((out / "decide2.json").read_text())["steps"]
    assert steps[0]["step"] == "sm90-backward-tests" and steps[0]["exit"] == "skipped"
    assert [s["exit"] for s in steps[1:]] == ["0"] * 7


def test_the_decode_bars_read_the_attention_rows_and_the_window_rows():
    """decide2's decode bars from bench_decode.py's rows: ``SDPA ms / ours ms`` of the attention
    alone at batch 1 (the whole steps, timed by their loop only and without ``ms``, and the
    window rows left out), the same for the reads replayed by their launch plans (a row whose
    plan was not replayed left out), and issue 44's ``window ms / last W+1 ms`` per N and batch,
    the worst GQA, against 1.2."""
    def row(n, batch, gqa, method, ms=None, **more):
        r = {"N": n, "batch": batch, "gqa": gqa, "method": method, "status": "ok",
             "loop_ms": 1.0, **more}
        return r if ms is None else {**r, "ms": ms}

    rows = [row(32768, 1, "4:1", "sdpa_fp16", 0.060), row(32768, 1, "4:1", "kv_int8_fp8", 0.080),
            row(32768, 1, "4:1", "kv_int8_fp8 plan", 0.050, plan_replayed=True),
            row(8192, 1, "4:1", "sdpa_fp16", 0.020),
            row(8192, 1, "4:1", "kv_int8_fp8 plan", 0.010, plan_replayed=False),
            row(32768, 1, "4:1", "sdpa_fp16+write"), row(32768, 1, "4:1", "kv_int8_fp8+append"),
            row(32768, 1, "4:1", "kv_int8_fp8 window 4096", 0.012),
            row(32768, 1, "4:1", "kv_int8_fp8 last 4097", 0.011),
            row(32768, 1, "8:1", "kv_int8_fp8 window 4096", 0.016),
            row(32768, 1, "8:1", "kv_int8_fp8 last 4097", 0.012),
            row(32768, 16, "4:1", "kv_int8_fp8 window 4096", 0.050),
            row(32768, 16, "4:1", "kv_int8_fp8 last 4097", 0.049)]
    stage_summary = script_module("benchmarks/probes/stage_summary.py")
    bars = {b["bar"]: b for b in stage_summary.decode_bars({"rows": rows})}
    decode = bars["decode batch 1 N=32k x SDPA (worst GQA)"]
    assert decode["value"] == pytest.approx(0.75) and decode["met"] is False
    assert bars["decode batch 1 N=8k x SDPA (worst GQA)"]["value"] is None
    planned = bars["decode batch 1 N=32k x SDPA (worst GQA), LOWBIT_ATTN_LAUNCH=plan"]
    assert planned["value"] == pytest.approx(1.2) and planned["met"] is True
    # a plan that was not replayed timed the normal path: no value
    assert bars["decode batch 1 N=8k x SDPA (worst GQA), LOWBIT_ATTN_LAUNCH=plan"]["value"] is None
    one = bars["decode window 4096 at N=32k batch 1 ÷ its last 4097 tokens alone (worst GQA)"]
    assert one["value"] == pytest.approx(16 / 12) and one["met"] is False  # 8:1 is the worst
    sixteen = bars["decode window 4096 at N=32k batch 16 ÷ its last 4097 tokens alone "
                   "(worst GQA)"]
    assert sixteen["value"] == pytest.approx(50 / 49) and sixteen["met"] is True


def test_the_split_rows_name_each_configuration_s_fastest_split():
    """decide2's summary of ``bench_decode.py --splits``: per configuration the production
    split's ms and × SDPA, the fastest candidate's keys per split, ms and × production (a failed
    row left out); then the keys per split fastest on every row, or "none"."""
    def row(n, batch, method, ms, pps=None, **more):
        r = {"N": n, "batch": batch, "gqa": "4:1", "method": method, "status": "ok", "ms": ms}
        if pps is not None:
            r.update(split_label=f"{64 * pps} keys per split", production=pps == 8)
        return {**r, **more}

    rows = [row(8192, 1, "sdpa_fp16", 0.02), row(8192, 1, "kv_int8_fp8 split 2", 0.01, 2),
            row(8192, 1, "kv_int8_fp8 split 8", 0.04, 8),
            row(8192, 1, "kv_int8_fp8 split 1", 0.001, 1, status="error: x"),
            row(32768, 16, "kv_int8_fp8 split 2", 0.5, 2),
            row(32768, 16, "kv_int8_fp8 split 8", 0.4, 8),
            row(32768, 16, "kv_int8_fp8 parts 64", 0.45, split_label="64 parts")]
    stage_summary = script_module("benchmarks/probes/stage_summary.py")
    bars = {b["bar"]: b["value"] for b in stage_summary.split_rows({"rows": rows})}
    assert bars == {
        "decode split, N=8k batch 1 GQA 4:1: production (512 keys per split) ms, 0.50x SDPA":
            0.04,
        "decode split, N=8k batch 1 GQA 4:1: fastest, 128 keys per split, ms, 4.00x "
        "production, 2.00x SDPA": 0.01,
        "decode split, N=32k batch 16 GQA 4:1: production (512 keys per split) ms": 0.4,
        "decode split, N=32k batch 16 GQA 4:1: fastest, 512 keys per split, ms, 1.00x "
        "production": 0.4,
        "decode split fastest on every row: none": None}


def test_the_preparation_rows_give_each_launch_s_time():
    """decide's summary of prep_speed.py: per shape, the statistics and quantizing launches' ms
    (with × its floor); a failed row, the copy and the parts' rows left out."""
    def row(name, ms, shape=(2, 32, 16384, 128), **more):
        return {"shape": list(shape), "name": name, "ms": ms, "mb": 1.0, "gbs": 1.0, **more}

    rows = [row("copy Q, K, V", 0.3), row("stats", 1.2, x_floor=7.0),
            row("torch stats", 2.6, x_floor=13.0),
            row("quantize K, Q, V", 0.8, x_floor=3.2), row("quantize K", 0.1),
            row("stats", float("nan"), shape=(1, 1, 1, 1), error="OutOfResources"),
            row("stats", 0.2, shape=(16, 32, 1024, 128), x_floor=4.0)]
    stage_summary = script_module("benchmarks/probes/stage_summary.py")
    got = [(b["bar"], b["value"]) for b in stage_summary.prep_rows({"rows": rows})]
    big = "[2, 32, 16384, 128]"
    assert got == [(f"stats {big}: ms (x its floor 7.0)", 1.2),
                   (f"quantize K, Q, V {big}: ms (x its floor 3.2)", 0.8),
                   ("stats [16, 32, 1024, 128]: ms (x its floor 4.0)", 0.2)]


def test_the_admission_probe_leaves_its_verdict_for_the_next_steps(tmp_path):
    """``probes/admission_time.py`` checks in a Triton cache of its own, then copies the verdict
    into the cache the next steps use: there a later process's first call is admitted from disk,
    with no check of its own (the stub check, on this machine)."""
    probe = ROOT / "benchmarks" / "probes" / "admission_time.py"
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "shared"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(probe), "stub", str(tmp_path / "out.json")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["cold"]["verdict"] is None
    assert result["cold"]["shared_to"] == str(tmp_path / "shared" / "lowbit_attn-admission")
    later = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); import admission_time as a; "
        "device, admitted = a._stub(); print(admitted(device))"), str(probe.parent)],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert later.returncode == 0 and later.stdout.strip() == "True", later.stderr[-3000:]


@pytest.mark.interpreter
def test_the_preparation_probe_runs_every_row_on_a_cpu(tmp_path):
    """benchmarks/probes/prep_speed.py --smoke: every launch of the GPU probe at a tiny shape on
    the interpreter (a launch that fails to compile would be a row with an error on the GPU:
    here it fails the test)."""
    probe = script_module("benchmarks/probes/prep_speed.py")
    probe.main([str(tmp_path / "prep-speed.json"), "--smoke"])
    rows = json.loads((tmp_path / "prep-speed.json").read_text())["rows"]
    names = [r["name"] for r in rows]
    assert names == ["copy Q, K, V", "stats", "torch stats", "quantize K, Q, V", "quantize K",
                     "quantize Q", "quantize V"]
    assert not [r for r in rows if "error" in r]
    table = (tmp_path / "prep-speed.md").read_text()
    assert table.startswith("# cpu (smoke); ") and "command: python benchmarks/probes/prep" in table
    assert table.count("\n") == len(rows) + 4  # the header, a blank line, the table's two heads


def test_a_warm_first_call_is_reported_without_the_cold_bar():
    """first_call.py's ``--warm`` rows (a later process's first call) show in its table with no
    verdict and give ``stage_summary`` no bar; the cold rows keep the 2 s bar."""
    rows = [{"d": 128, "mode": "serial", "cache": "cold", "status": "ok", "first_call_s": 2.3,
             "second_call_s": 0.001, "import_s": 1.2, "context_s": 0.3, "triton_key_s": 0.34,
             "hash_ahead": True},
            {"d": 128, "mode": "serial", "cache": "warm", "status": "ok", "first_call_s": 0.19,
             "second_call_s": 0.001, "import_s": 1.2, "context_s": 0.3, "triton_key_s": 0.34,
             "hash_ahead": False}]
    first_call = script_module("benchmarks/probes/first_call.py")
    lines = first_call.table(rows).splitlines()
    assert lines[2].endswith("| 0.34 (yes) | no |") and "| cold | 2.30 |" in lines[2]
    assert lines[3].endswith("| 0.34 (no) | — |") and "| warm | 0.19 |" in lines[3]
    stage_summary = script_module("benchmarks/probes/stage_summary.py")
    bars = stage_summary.first_bars({"rows": rows})
    assert [(b["value"], b["met"]) for b in bars] == [(2.3, False)]


def test_a_warm_first_call_is_a_new_shape(monkeypatch):
    """A warm case's cache is filled by a process at another length than the one measured (the
    first call of a new shape on a machine that ran the package before); a cold case runs one
    process; ``--caches`` orders the cases cold first."""
    import subprocess

    first_call = script_module("benchmarks/probes/first_call.py")
    runs = []

    def run(argv, **kw):
        runs.append((argv, kw["env"]["TRITON_CACHE_DIR"]))
        return subprocess.CompletedProcess(argv, 0, 'RESULT {"first_call_s": 1.0}\n', "")

    monkeypatch.setattr(first_call.subprocess, "run", run)
    assert first_call.run_case(128, "parallel", cpu=True, warm=True)["cache"] == "warm"
    (fill, cache), (measured, same) = runs
    assert fill[-2:] == ["--tokens", str(first_call.FILL_TOKENS)] and "--tokens" not in measured
    assert cache == same and first_call.FILL_TOKENS != first_call.SHAPE[2]
    runs.clear()
    assert first_call.run_case(64, "parallel", cpu=True)["cache"] == "cold" and len(runs) == 1

