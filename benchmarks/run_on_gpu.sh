#!/usr/bin/env bash
# GPU run for the device machine (H100, Triton 3.6, torch 2.11, CUDA 13, no network), in one call:
# environment report, GPU correctness tests (pytest -m gpu), then the full benchmark of
# DESIGN.md ("Benchmark protocol"), its short table printed last.
#
#   bash benchmarks/run_on_gpu.sh [all|tests|bench|quick|fp4|train|vsa|hopper|decode|forward|
#                                  decide|decide2]   (default: all)
#
# decide (issue 43; TOTAL_BUDGET 470 s by default, one call of <= 9 minutes with the machine's
# start): the one-warpgroup forward's GPU tests with its admission check (-k sm90, forward
# only, at most 150 s), the admission timed (benchmarks/probes/admission_time.py, at most 90 s:
# a first call with no verdict, the check itself on a cold Triton cache in the background, a
# later process's read of the verdict, the check on the warm cache), the preparation's launches
# timed apart against their floor with both launches' candidate tilings
# (benchmarks/probes/prep_speed.py, at most 80 s; embedded in decide.json), then
# bench_forward.py --decide
# (D=128 N=16k, N=1k at B×H=512, D=64 the same, causal D=128 N=16k, then N=8k; SDPA cuDNN, the sm90
# rows, SageAttention 1.0.6; each row's first call timed) in the time left.
# decide2 (470 s): the sm90 backward's GPU tests with its admission check (at most 120 s; skipped
# when under 70 s are left for them, rather than cut short), the
# same four admission times (90 s), bench_train.py (D=128, N=8k,4k,16k, SDPA flash against
# sagebwd_int8 on the Triton backward and on the sm90 loops; 130 s), train_speed.py --quick (each
# launch of the default training call, the sm90 loops' among them, against its tensor-core floor,
# N=16k; 75 s, its lines in decide2.log; video sparse attention's sm90 rows of 2026-11-29 stand),
# bench_decode.py (N=32k then 8k at batch 1, the bars' batch; GQA 4:1, each read and eager step
# also replayed by its launch plan, and issue 44's 4096-token sliding window against a full layer
# of the 4097 tokens it sees; saved after every row; at most 90 s), the decode kernel's pages
# per split (bench_decode.py --splits 1,2,4,8,16 --parts 32,64,128 at N=32k and 8k, batch 1 then
# 16: the launcher alone against SDPA, the candidates for core/measured.py DECODE_SPLITS; at most
# 70 s), the first call of a new shape with the kernels compiled side by side (the default), on a
# cold Triton cache, then on one an earlier process filled at another length
# (benchmarks/probes/first_call.py --caches cold,warm, D=128 and 64, a process each; at most
# 45 s), then the launch plans' GPU tests with
# LOWBIT_ATTN_LAUNCH=plan (tests/test_gpu_plans.py) in the time left (~85 s: on the
# H200 of 2026-11-29 60 s in decide left 3 of them unreached, those waiting for the Gluon
# forward's cold admission check; plans are opt-in, so they come after what decides defaults).
# Each step runs under `timeout` with the smaller of its cap and what TOTAL_BUDGET leaves after
# the time kept for the later steps (skipped, and recorded so, when under 20 s are left). After
# every step, benchmarks/probes/stage_summary.py rewrites $OUT/STAGE.json and STAGE.md (device,
# date, command, each step's limit, time and exit, issue 43's bars beside the values, the
# admission timings, the benchmarks' own JSON embedded and tables appended), so a run cut short
# still leaves them; the benchmarks save after every configuration. $OUT gets at most 7 files:
# pytest-STAGE.log, STAGE.log, STAGE.json, STAGE.md, failures.txt (if a test failed), and for
# decide forward-*.json and .md.
#
# forward: the 8-bit forward's candidates (issue 36): the one-warpgroup kernel's GPU tests
# (pytest -m gpu -k sm90, at most FORWARD_TEST_TIMEOUT, default 120 s: against the twin, every
# option, its opt-in check), then benchmarks/bench_forward.py (the sm90 kernel per thread and per
# token, K buffers, register cap, fp16 P.V; the Triton kernel; kernel alone and end to end; SDPA
# cuDNN and flash, SageAttention 1.0.6; D=128,64 x N=16k,1k,4k x causal, most decisive first),
# then, in the last NCU_RESERVE seconds (default 45), ncu's stall reasons for one launch
# (benchmarks/probes/forward_ncu.py; --clock-control none).
#
# fp4: the FP4 recipes alone (GPU tests -k fp4, the Gluon sm_100a forward's among them, then a
# quick benchmark of qk_fp4_pv_fp4 and qk_mxfp4_pv_mxfp4 against SDPA cuDNN, with the default
# kernels and with LOWBIT_ATTN_KERNEL=gluon): emulated on Hopper, native on Blackwell.
# train: the trainable attention in one call of at most 450 s (TOTAL_BUDGET): GPU tests -k trainable
# (at most TEST_TIMEOUT_TRAIN, default 120 s; the sm90 backward loops' among them), then
# benchmarks/bench_train.py (TRAIN_ARGS, default --quick --dims 128,64 and the methods SDPA flash,
# SDPA cuDNN, sagebwd_int8 and sagebwd_int8_per_row on the Triton backward and on the Gluon loops
# LOWBIT_ATTN_BWD_KERNEL=sm90 (…_sm90), and last sagebwd_int8 with LOWBIT_ATTN_TRAIN_DQ=atomic
# (…_atomic_dq: the placement issue 43 asks to decide); forward + backward, peak memory, gradient
# cosines), then
# benchmarks/probes/train_speed.py in the last RESERVE seconds (default 150): each launch of a
# forward + backward alone against its floor over the card's measured INT8/bf16 ceilings, every
# autotuning candidate forced, each compiled variant's registers, spills and wgmma forms, and the
# backward on the sm90 loops, whole and launch by launch.
# hopper: the INT8/FP8 forward's speed work (the 8-bit forward's GPU tests, then bench_hopper.py:
# every autotuning candidate, Q quantized in the kernel or in a pass, the two stages apart, against
# SDPA cuDNN bf16 at D=64,128, N=1k,8k,16k, causal and not; HOPPER_ARGS adds options, e.g. --quick).
# vsa: video sparse attention in at most 450 s (GPU tests -k "vsa or video", at most
# TEST_TIMEOUT_VSA, default 120 s, then benchmarks/bench_vsa.py: T=16, H=W=48, D=128, VSA_ARGS
# (default --sparsities 0.875,0.5) against SDPA cuDNN dense, the fine kernel's FLOP rate, the
# backward on the Triton kernels and on the sm90 loops, rows [sm90]).
# decode: the 8-bit paged KV cache: bench_decode.py --host (µs per eager read and one-token append,
# N=8k, batch 16), the GPU tests -k "kvcache or kv_cache", benchmarks/bench_decode.py (one decode
# step against SDPA on fp16 K/V, N=1k..128k, batch 1 and 16, GQA 4:1 and 8:1, D=128, with the bytes
# read and the card's measured copy bandwidth as the floor, GPU time, host time and loop time),
# then benchmarks/probes/decode_speed.py (host time by part; pages per split x pipeline stages x
# register cap) in the last RESERVE seconds (default 180).
#
# The wheels travel in wheels/ (ignored by git: pass it in the device tool's `carry`):
# sageattention-1.0.6 (the SageAttention baseline) and pytest with its dependencies (installed only
# if the machine lacks pytest). Results go to $OUT (what comes back from the device machine) and to
# benchmarks/results/. Time: the whole script stays under TOTAL_BUDGET seconds (default 540, for
# the tool's 600 s limit): the tests get at most TEST_TIMEOUT (default 300) and the benchmark
# stops starting measurements when the budget is spent (recorded as skipped; partial results are
# saved after every configuration).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE="${1:-all}"
PY="${PYTHON:-python}"
export OUT="${OUT:-$PWD/out}"
# forward, train, vsa: 450 s by default, so that the call stays within 8 minutes with the
# machine's start
if [[ "$STAGE" == forward || "$STAGE" == train || "$STAGE" == vsa ]]; then DEFAULT_BUDGET=450
elif [[ "$STAGE" == decide || "$STAGE" == decide2 ]]; then DEFAULT_BUDGET=470
else DEFAULT_BUDGET=540; fi
TOTAL_BUDGET="${TOTAL_BUDGET:-$DEFAULT_BUDGET}"
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"
mkdir -p "$OUT" benchmarks/results
SITE="$(mktemp -d)/site"
mkdir -p "$SITE"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

log() { echo "== $*" >&2; }

# pytest on the GPU machine: its compiles spread over 16 processes where pytest-xdist is there
# (the whole `-m gpu` took 248 s so on an H100, 2026-11-25), each failure's report written to
# $OUT/failures.txt as it happens (benchmarks/probes/faillog.py: a run cut by its limit keeps them).
export PYTHONPATH="$PWD/benchmarks/probes:$PYTHONPATH"
# The tests run each autotuned kernel's first candidate alone (LOWBIT_ATTN_AUTOTUNE=first: one
# compile per new shape, not one per candidate; tests/test_gpu.py checks every INT8 candidate on
# its own); TEST_AUTOTUNE=all restores the autotuner. The benchmarks run what users get: the
# candidate core/measured.py names where it has one (LOWBIT_ATTN_AUTOTUNE=measured, the default),
# else the autotuner; bench_forward.py's "tuned" rows autotune to show what it would pick.
PYTEST=(env LOWBIT_ATTN_AUTOTUNE="${TEST_AUTOTUNE:-first}" "$PY" -m pytest -q -p no:cacheprovider
        -p faillog)
if "$PY" -c "import xdist" 2>/dev/null; then PYTEST+=(-n 16); fi

# Pure-Python wheels: pip without the network; where pip cannot write (or refuses), unpack them
# onto PYTHONPATH instead (a wheel is a zip of the installed files).
install_wheels() {
    "$PY" -m pip install --no-index --no-deps --quiet "$@" 2>/dev/null && return 0
    log "pip could not install $*; unpacking into $SITE"
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$SITE" || return 1; done
    export PYTHONPATH="$SITE:$PYTHONPATH"
}

log "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -4
"$PY" - <<'EOF'
import platform, torch, triton
print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}  "
      f"CUDA {torch.version.cuda}  cuDNN {torch.backends.cudnn.version()}")
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'}")
EOF

if ! "$PY" -c "import sageattention" 2>/dev/null; then
    if compgen -G "wheels/sageattention-*.whl" >/dev/null; then
        install_wheels wheels/sageattention-*.whl || log "sageattention could not be installed"
    else
        log "no wheels/sageattention-*.whl (carry wheels/): the SageAttention rows will say so"
    fi
fi
"$PY" -c "import sageattention, importlib.metadata as m; print('sageattention', m.version('sageattention'))" \
    || log "sageattention not importable"
# The first line of every log this run writes (and of $OUT/failures.txt, benchmarks/probes/
# faillog.py): the device, the date and the command that produced it.
DEVICE_NAME="$("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" 2>/dev/null || echo "device unknown")"
export RUN_HEADER="# ${DEVICE_NAME}; $(date -u +%Y-%m-%dT%H:%M:%SZ); command: bash benchmarks/run_on_gpu.sh $STAGE (TOTAL_BUDGET=$TOTAL_BUDGET)"

rc_tests=0
if [[ "$STAGE" == all || "$STAGE" == tests ]]; then
    if ! "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
        mapfile -t TEST_WHEELS < <(ls wheels/*.whl 2>/dev/null | grep -v -e sageattention -e typing_extensions)
        if ((${#TEST_WHEELS[@]})); then
            install_wheels "${TEST_WHEELS[@]}" || log "test wheels could not be installed"
        fi
    fi
    log "GPU tests: pytest -m gpu (at most ${TEST_TIMEOUT} s; full log in \$OUT/pytest-gpu.log)"
    started=$SECONDS
    timeout -k 10 "$TEST_TIMEOUT" "${PYTEST[@]}" -m gpu --durations=30 >"$OUT/pytest-gpu.log" 2>&1
    rc_tests=$?
    log "GPU tests took $((SECONDS - started)) s (issue 31's bar: 240 s); the 30 slowest phases:"
    grep -E '^[0-9.]+s (setup|call|teardown) ' "$OUT/pytest-gpu.log" | head -n 30
    log "skipped, by reason (count, reason):"
    grep '^SKIPPED' "$OUT/pytest-gpu.log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^ ]+: /\1 /' \
        | awk '{n = $1; $1 = ""; count[$0] += n} END {for (r in count) print count[r] r}' \
        | sort -rn
    tail -n 5 "$OUT/pytest-gpu.log"
    case $rc_tests in
        0) log "GPU tests passed" ;;
        5) log "no GPU tests were collected" ;;
        124) log "GPU tests stopped after ${TEST_TIMEOUT} s" ;;
        *) log "GPU tests FAILED (exit $rc_tests)" ;;
    esac
fi

if [[ "$STAGE" == fp4 ]]; then
    log "FP4 GPU tests: pytest -m gpu -k fp4"
    timeout -k 10 "$TEST_TIMEOUT" "${PYTEST[@]}" -m gpu -k fp4 >"$OUT/pytest-gpu-fp4.log" 2>&1
    rc_tests=$?
    tail -n 25 "$OUT/pytest-gpu-fp4.log"
    # half the time left for the default kernels, half for LOWBIT_ATTN_KERNEL=gluon (the Gluon
    # FP4 forward on sm_100; elsewhere the same Triton kernels again)
    budget=$(((TOTAL_BUDGET - SECONDS - 30) / 2))
    if ((budget < 60)); then budget=60; fi
    rc_bench=0
    for kernel in triton gluon; do
        log "FP4 benchmark (quick, vs SDPA cuDNN), LOWBIT_ATTN_KERNEL=$kernel"
        LOWBIT_ATTN_KERNEL=$kernel "$PY" -m lowbit_attn.tools.bench \
            --recipes qk_fp4_pv_fp4,qk_mxfp4_pv_mxfp4 --baselines cudnn --quick --out "$OUT" \
            --out benchmarks/results --time-budget "$budget" --no-progress \
            >"$OUT/bench-fp4-$kernel-table.txt" 2>"$OUT/bench-fp4-$kernel.log" || rc_bench=$?
        tail -n 20 "$OUT/bench-fp4-$kernel.log"
    done
    log "summary: FP4 GPU tests exit $rc_tests, FP4 benchmark exit $rc_bench, ${SECONDS} s"
    cat "$OUT/bench-fp4-triton-table.txt" "$OUT/bench-fp4-gluon-table.txt"
    exit $((rc_tests != 0 && rc_tests != 5 ? rc_tests : rc_bench))
fi

# The 8-bit forward's host path (issue 27): host µs per call and launches, real launches, with
# the functions that take the time, in $OUT/host.txt (~30 s: 1400 calls per row).
if [[ "$STAGE" == all || "$STAGE" == bench || "$STAGE" == quick || "$STAGE" == hopper ]]; then
    log "host path: python -m lowbit_attn.tools.bench --host (in \$OUT/host.txt)"
    # with launch plans (opt-in since issue 43: the bars of issue 27 are theirs)
    LOWBIT_ATTN_LAUNCH=plan timeout -k 10 120 "$PY" -m lowbit_attn.tools.bench --host --recipes qk_int8_pv_fp8,qk_int8_pv_fp16 \
        --dims 64,128 --seqlens 1k,8k --host-profile >"$OUT/host.txt" 2>&1
    grep -e host_us -e bars "$OUT/host.txt"
fi

# One feature's GPU tests (pytest -m gpu -k FILTER), then its benchmark script, in one stage.
tests_then_bench() {
    local name="$1" filter="$2" script="$3"
    shift 3  # the rest: options for the script
    local tag
    tag="$(basename "$script" .py)"  # in the log and table file names
    log "$name GPU tests: pytest -m gpu -k \"$filter\""
    timeout -k 10 "$TEST_TIMEOUT" "${PYTEST[@]}" -m gpu -k "$filter" \
        >"$OUT/pytest-gpu-$tag.log" 2>&1
    rc_tests=$?
    tail -n 25 "$OUT/pytest-gpu-$tag.log"
    log "$name benchmark: $script (log in \$OUT/$tag.log)"
    local outs=(--out "$OUT")
    if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        outs+=(--out benchmarks/results)  # kernel results only, never CPU timings
    fi
    local limit=$((TOTAL_BUDGET - SECONDS - 10 - ${RESERVE:-0}))
    if ((limit < 60)); then limit=60; fi  # the tests ran long: the benchmark still gets a minute
    timeout -k 10 "$limit" "$PY" "$script" "${outs[@]}" "$@" >"$OUT/$tag-table.md" 2>"$OUT/$tag.log"
    rc_bench=$?
    tail -n 40 "$OUT/$tag.log"
    log "summary: $name GPU tests exit $rc_tests, benchmark exit $rc_bench, ${SECONDS} s"
    cat "$OUT/$tag-table.md"
    exit $((rc_tests != 0 && rc_tests != 5 ? rc_tests : rc_bench))
}

# tests_then_bench, leaving the last RESERVE seconds to a probe of where the time goes (its
# output in $OUT/TAG-probe.txt); exits with the tests' or benchmark's status.
with_probe() {
    local name="$1" filter="$2" script="$3" probe="$4" tag="$5" reserve="$6"
    shift 6  # the rest: options for the script
    (RESERVE="${RESERVE:-$reserve}" tests_then_bench "$name" "$filter" "$script" "$@")
    local rc=$?
    log "$name probe: $probe"
    local limit=$((TOTAL_BUDGET - SECONDS - 5))
    if ((limit < 30)); then limit=30; fi
    timeout -k 10 "$limit" "$PY" "$probe" >"$OUT/$tag-probe.txt" 2>&1
    tail -n 120 "$OUT/$tag-probe.txt"
    exit $rc
}

# train: the probe times each launch against its floor, every candidate, with compiled facts
# shellcheck disable=SC2086  # TRAIN_ARGS, VSA_ARGS: options split on spaces
[[ "$STAGE" == train ]] && TEST_TIMEOUT="${TEST_TIMEOUT_TRAIN:-120}" with_probe \
    "trainable attention" trainable benchmarks/bench_train.py benchmarks/probes/train_speed.py \
    train 150 ${TRAIN_ARGS:---quick --dims 128,64 --methods sdpa_flash,sdpa_cudnn,sagebwd_int8,sagebwd_int8_sm90,sagebwd_int8_per_row,sagebwd_int8_per_row_sm90,sagebwd_int8_atomic_dq}
# shellcheck disable=SC2086
[[ "$STAGE" == vsa ]] && TEST_TIMEOUT="${TEST_TIMEOUT_VSA:-120}" tests_then_bench \
    "video sparse attention" "vsa or video" benchmarks/bench_vsa.py ${VSA_ARGS:---sparsities 0.875,0.5}
if [[ "$STAGE" == decode ]]; then
    # the host path first (~20 s): µs per eager read and one-token append, N = 8k, batch 16
    log "decode host path: bench_decode.py --host (issue 29's bars: 30 and 20 us; in \$OUT/decode-host.txt)"
    LOWBIT_ATTN_LAUNCH=plan timeout -k 10 90 "$PY" benchmarks/bench_decode.py --host --host-profile >"$OUT/decode-host.txt" 2>&1
    grep -e host_us -e bars "$OUT/decode-host.txt"
    # the probe: host time by part, the launch sweep
    with_probe "KV-cache decode" "kvcache or kv_cache" benchmarks/bench_decode.py \
        benchmarks/probes/decode_speed.py decode 180
fi
# shellcheck disable=SC2086  # HOPPER_ARGS: options split on spaces
[[ "$STAGE" == hopper ]] && tests_then_bench "Hopper speed" "not fp4 and not trainable and not vsa and not video" \
    benchmarks/bench_hopper.py \
    --time-budget $((TOTAL_BUDGET - SECONDS - TEST_TIMEOUT - 40)) ${HOPPER_ARGS:-}

if [[ "$STAGE" == forward ]]; then
    log "one-warpgroup forward GPU tests: pytest -m gpu -k sm90 (at most ${FORWARD_TEST_TIMEOUT:-120} s)"
    timeout -k 10 "${FORWARD_TEST_TIMEOUT:-120}" "${PYTEST[@]}" -m gpu -k sm90 \
        >"$OUT/pytest-gpu-sm90.log" 2>&1
    rc_tests=$?
    tail -n 25 "$OUT/pytest-gpu-sm90.log"
    outs=(--out "$OUT")
    if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        outs+=(--out benchmarks/results)  # kernel results only, never CPU timings
    fi
    limit=$((TOTAL_BUDGET - SECONDS - ${NCU_RESERVE:-45}))
    if ((limit < 60)); then limit=60; fi
    log "benchmark: bench_forward.py (log in \$OUT/bench_forward.log; configurations stop starting 60 s before ${limit} s)"
    timeout -k 10 "$limit" "$PY" benchmarks/bench_forward.py "${outs[@]}" --time-budget $((limit - 60)) \
        >"$OUT/bench_forward-table.md" 2>"$OUT/bench_forward.log"
    rc_bench=$?
    tail -n 15 "$OUT/bench_forward.log"
    limit=$((TOTAL_BUDGET - SECONDS - 5))
    if command -v ncu >/dev/null && ((limit >= 20)); then
        log "ncu stall reasons of one sm90 launch (at most ${limit} s; in \$OUT/ncu-sm90.txt)"
        timeout -k 10 "$limit" ncu --clock-control none -k regex:_attn_fwd_sm90 -s 1 -c 1 \
            --section WarpStateStats --section SchedulerStats --section Occupancy \
            --section ComputeWorkloadAnalysis "$PY" benchmarks/probes/forward_ncu.py \
            >"$OUT/ncu-sm90.txt" 2>&1 || log "ncu failed (exit $?): see \$OUT/ncu-sm90.txt"
        grep -E "Stall|Issued|Eligible|Occupancy|Block Limit|Registers|No Eligible|Pipe|XU" \
            "$OUT/ncu-sm90.txt" | head -40
    else
        log "no ncu run (ncu missing or no time left)"
    fi
    log "summary: sm90 GPU tests exit $rc_tests, benchmark exit $rc_bench, ${SECONDS} s"
    cat "$OUT/bench_forward-table.md"
    exit $((rc_tests != 0 && rc_tests != 5 ? rc_tests : rc_bench))
fi

if [[ "$STAGE" == decide || "$STAGE" == decide2 ]]; then
    WORK="$(mktemp -d)"  # admission timings, and decide2's benchmark files (summarized into $OUT)
    STEPS="$WORK/steps.tsv"
    : >"$STEPS"
    COMMAND="bash benchmarks/run_on_gpu.sh $STAGE (TOTAL_BUDGET=$TOTAL_BUDGET)"
    MIN_STEP=20
    RESULTS=()
    if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        RESULTS=(--out benchmarks/results)  # kernel results only, never CPU timings
    fi
    summary() {
        "$PY" benchmarks/probes/stage_summary.py "$STAGE" "$OUT" "$STEPS" "$COMMAND" "$WORK" \
            "$OUT" >/dev/null 2>>"$OUT/$STAGE.log" || log "the summary failed (see \$OUT/$STAGE.log)"
    }
    # limit CAP RESERVE: LIMIT = the smaller of CAP and what the budget leaves after RESERVE s
    # kept for the later steps
    limit() {
        local left=$((TOTAL_BUDGET - SECONDS - $2))
        LIMIT=$(($1 < left ? $1 : left))
    }
    # step NAME LOGFILE CMD...: CMD under `timeout $LIMIT` (skipped under MIN_STEP s, or under
    # NEED s when the call sets it: a step that cut short says nothing), its output appended to
    # LOGFILE, the step recorded and the summary rewritten
    step() {
        local name="$1" logfile="$2" started=$SECONDS rc
        shift 2
        if ((LIMIT < ${NEED:-$MIN_STEP})); then
            log "step $name: skipped (${LIMIT} s left for it)"
            printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$LIMIT" "$started" 0 skipped >>"$STEPS"
            summary
            return 0
        fi
        log "step $name: at most $LIMIT s (at $started s of $TOTAL_BUDGET)"
        echo "== step $name: $*" >>"$logfile"
        timeout -k 10 "$LIMIT" "$@" >>"$logfile" 2>&1
        rc=$?
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$LIMIT" "$started" "$((SECONDS - started))" "$rc" \
            >>"$STEPS"
        log "step $name: exit $rc after $((SECONDS - started)) s"
        summary
        return $rc
    }
    TESTLOG="$OUT/pytest-$STAGE.log"
    BENCHLOG="$OUT/$STAGE.log"
    echo "$RUN_HEADER" >"$TESTLOG"
    echo "$RUN_HEADER" >"$BENCHLOG"
    summary
    rc_tests=0
    rc_bench=0
    if [[ "$STAGE" == decide ]]; then
        limit 150 270
        step sm90-forward-tests "$TESTLOG" "${PYTEST[@]}" -m gpu tests/test_gpu.py \
            -k "sm90 and not trainable and not video and not backward" --durations=10 \
            || rc_tests=$?
        limit 90 210
        step sm90-forward-admission "$BENCHLOG" "$PY" benchmarks/probes/admission_time.py fwd \
            "$WORK/admission-fwd.json" || rc_bench=$?
        limit 80 150
        step prep "$BENCHLOG" "$PY" benchmarks/probes/prep_speed.py "$WORK/prep-speed.json" \
            || rc_bench=$?
        limit 600 10
        step forward-sweep "$BENCHLOG" "$PY" benchmarks/bench_forward.py --decide --out "$OUT" \
            --out "$WORK" "${RESULTS[@]}" --time-budget $((LIMIT - 60)) || rc_bench=$?
    else
        limit 120 340  # they took 62 s whole on the H200 of 2026-11-29 (24 s cut them short)
        NEED=70 step sm90-backward-tests "$TESTLOG" "${PYTEST[@]}" -m gpu tests/test_gpu.py \
            -k "trainable_sm90 or video_sparse_sm90 or sm90_backward" --durations=10 \
            || rc_tests=$?
        limit 90 250
        step sm90-backward-admission "$BENCHLOG" "$PY" benchmarks/probes/admission_time.py bwd \
            "$WORK/admission-bwd.json" || rc_bench=$?
        limit 130 120
        step train "$BENCHLOG" "$PY" benchmarks/bench_train.py --dims 128 --ns 8192,4096,16384 \
            --methods sdpa_flash,sagebwd_int8,sagebwd_int8_sm90 --out "$WORK" "${RESULTS[@]}" \
            --time-budget $((LIMIT - 40)) || rc_bench=$?
        limit 75 45  # where the training call's time goes, launch by launch (into $STAGE.log)
        step train-probe "$BENCHLOG" "$PY" benchmarks/probes/train_speed.py --quick \
            || rc_bench=$?
        limit 90 160  # after it: the splits (~40 s), the first call (45) and the plan tests
        step decode "$BENCHLOG" "$PY" benchmarks/bench_decode.py --seqlens 32k,8k --batches 1 \
            --groups 4 --window 4096 --out "$WORK" "${RESULTS[@]}" || rc_bench=$?
        limit 70 130
        step decode-splits "$BENCHLOG" "$PY" benchmarks/bench_decode.py --seqlens 32k,8k \
            --batches 1,16 --groups 4 --splits 1,2,4,8,16 --parts 32,64,128 --out "$WORK" \
            "${RESULTS[@]}" || rc_bench=$?
        limit 45 85
        step first-call "$BENCHLOG" "$PY" benchmarks/probes/first_call.py "$WORK" \
            --modes parallel --caches cold,warm || rc_bench=$?
        limit 600 5
        step plan-tests "$TESTLOG" env LOWBIT_ATTN_LAUNCH=plan "${PYTEST[@]}" -m gpu \
            tests/test_gpu_plans.py || rc_tests=$((rc_tests && rc_tests != 5 ? rc_tests : $?))
    fi
    log "summary: tests exit $rc_tests, benchmarks exit $rc_bench, ${SECONDS} s; files in \$OUT:"
    ls "$OUT"
    tail -n 20 "$TESTLOG" 2>/dev/null
    cat "$OUT/$STAGE.md"
    exit $((rc_tests != 0 && rc_tests != 5 ? rc_tests : rc_bench))
fi

rc_bench=0
if [[ "$STAGE" == all || "$STAGE" == bench || "$STAGE" == quick ]]; then
    budget=$((TOTAL_BUDGET - SECONDS - 25))
    if ((budget < 60)); then budget=60; fi
    args=(--out "$OUT" --time-budget "$budget" --no-progress)
    if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        args+=(--out benchmarks/results)
    else
        log "NO CUDA: the benchmark will only time the CPU reference (not a kernel benchmark)"
    fi
    [[ "$STAGE" == quick ]] && args+=(--quick)
    log "benchmark: python -m lowbit_attn.tools.bench ${args[*]} (log in \$OUT/bench.log)"
    "$PY" -m lowbit_attn.tools.bench "${args[@]}" >"$OUT/bench-table.txt" 2>"$OUT/bench.log"
    rc_bench=$?
    grep -v -e '^  D=' "$OUT/bench.log" | tail -n 40
    log "measurements that are not ok (unsupported, oom, error, failed check):"
    grep -e '^  D=' "$OUT/bench.log" | grep -v ' pass$' | grep -v -E 'prepare: [0-9.]+ ms$' | tail -n 30
    log "benchmark exit $rc_bench (1 = one of our rows failed its check or raised); files in \$OUT:"
    ls "$OUT"
    echo
    log "summary: GPU tests exit $rc_tests, benchmark exit $rc_bench, ${SECONDS} s"
    cat "$OUT/bench-table.txt"
fi
exit $((rc_tests != 0 && rc_tests != 5 ? rc_tests : rc_bench))
