#!/usr/bin/env bash
# The CUDA checks of issue 6 in one command, sized for a 10-minute call on one H200 (about 8 minutes):
#   1 nvidia-smi    the card, its memory and driver
#   2 imports       torch + CUDA, triton, transformers, the project's deps, nanoinfer's kernels
#   3 pytest        tests/gpu (engine vs transformers on the GPU, MoE and sinks included, CUDA graphs vs eager, planner vs
#                   allocation) and tests/kernels with the Triton kernels compiled (TRITON_INTERPRET=0)
#   4 plan-memory   the planner's estimate for the Qwen3-0.6B-shaped bench model on this card
#   5 decode-variants  the Triton decode attention's variants (tiles, warps, stages, splits), flash-attn and
#                   FlashInfer when they import, each checked and timed (do_bench, CUDA graphs) against the
#                   HBM floor for the bench's shapes, bfloat16 and fp8 caches; names the winners
#                   (benchmarks/tools/decode_variants.py)
#   6 bench         nanoinfer vs HF transformers on nano-vllm's workload (256 requests, 100-1024 in/out), with
#                   the roofline: each class of step against its floor (bytes / HBM bandwidth, FLOPs / peak)
#   7 bench-fp8     the same workload with kv_cache_dtype fp8 (nanoinfer only), when time is left
# then prints a table (scripts/gpu_check_summary.py). Exits non-zero if any step failed or timed out.
# For issue 39's checks in one 10-minute call (variants, full bench with its roofline, fp8 bench):
#   GPU_CHECK_BUDGET_S=540 GPU_CHECK_COMPARE=off GPU_CHECK_SMALL_OPS_AB=off bash scripts/gpu_check.sh
#
# Installs nothing from the network. torch, CUDA and Triton must be there already (flash-attn is optional);
# missing pure-Python dependencies are installed from ./wheels when that folder exists (pip --no-index; on
# a system Python that refuses pip, set PIP_BREAK_SYSTEM_PACKAGES=1), else the imports step names them.
# nanoinfer itself need not be installed: src/ goes first on PYTHONPATH and the CLI runs as python -m.
#
# Usage: bash scripts/gpu_check.sh
# Environment:
#   PYTHON              interpreter with torch (default: python3)
#   GPU_LOG_DIR         where logs go (default: gpu_logs): steps.tsv, one log per step, pytest.xml,
#                       plan-memory.json, bench.json, summary.txt
#   GPU_CHECK_BUDGET_S  seconds for all steps together (default: 480); each step's timeout comes out of it
#   GPU_CHECK_BENCH     auto (default) | full | small | off. auto runs the full workload when at least
#                       BENCH_FULL_MIN_S (240 s) are left, else the small one (64 requests, 100-512 in/out),
#                       which needs BENCH_SMALL_MIN_S (90 s); with less left the bench is skipped (a failure).
#   GPU_CHECK_SMALL_OPS_AB  auto (default) | off. auto: after a passing bench, the same workload once more with
#                       NANOINFER_TORCH_SMALL_OPS=1 (torch's small ops instead of the Triton ones; nanoinfer only,
#                       no HF), so the table gives their speed-up from one call; AB_RESERVE_S (75 s) is kept for it.
#   GPU_CHECK_TESTS     the test paths pytest runs (default: "tests/gpu tests/kernels"), e.g. tests/gpu alone for
#                       a rerun after the kernel tests passed, leaving the full bench more time
#   GPU_CHECK_VARIANTS  auto (default) | off: the decode-variants step (capped at VARIANTS_MAX_S, 150 s, and never
#                       into the small bench's time)
#   GPU_CHECK_COMPARE   hf (default) | off: off runs the bench without the HF peer (~130 s less on the full workload)
#   GPU_CHECK_FP8_BENCH auto (default) | off. auto: after a passing bench, its workload once more with
#                       --kv-cache-dtype fp8 (nanoinfer only) when FP8_BENCH_MIN_S (60 s) are left
# shellcheck disable=SC2329  # the step_* functions run through `timeout ... bash -c`
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
LOG_DIR=${GPU_LOG_DIR:-gpu_logs}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
BENCH_MODE=${GPU_CHECK_BENCH:-auto}
TESTS=${GPU_CHECK_TESTS:-tests/gpu tests/kernels}
BENCH_FULL_MIN_S=240
BENCH_SMALL_MIN_S=90
SMALL_OPS_AB=${GPU_CHECK_SMALL_OPS_AB:-auto}
AB_RESERVE_S=75
VARIANTS=${GPU_CHECK_VARIANTS:-auto}
VARIANTS_MAX_S=150
COMPARE=${GPU_CHECK_COMPARE:-hf}
FP8_BENCH=${GPU_CHECK_FP8_BENCH:-auto}
FP8_BENCH_MIN_S=60
SMALL_BENCH=(--num-requests 64 --input-len 100 512 --output-len 100 512)
mkdir -p "$LOG_DIR" || exit 2
LOG_DIR=$(cd "$LOG_DIR" && pwd)
STEPS="$LOG_DIR/steps.tsv"
# Files of an earlier run would pass for this run's results in the table.
rm -f "$LOG_DIR"/{steps.tsv,meta.txt,summary.txt,nvidia-smi.csv,imports.json,pytest.xml,plan-memory.json,bench.json}
rm -f "$LOG_DIR"/{nvidia-smi,imports,pytest,plan-memory,bench,small-ops-ab,decode-variants,bench-fp8}.log
rm -f "$LOG_DIR"/{bench-torch-small-ops,decode-variants,bench-fp8}.json
printf 'step\tstatus\trc\tseconds\tlog\tnote\n' >"$STEPS"

export ROOT LOG_DIR PY TESTS COMPARE
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # no internet there: fail fast
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONUNBUFFERED=1 COLUMNS=160  # rich tables in the logs at full width

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
    echo "python: $(command -v "$PY" || echo "$PY not found")"
    echo "budget_s: $BUDGET"
} >"$LOG_DIR/meta.txt"

any_failed=0

record() { # step status rc seconds log note
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(basename "$5")" "${6:-}" >>"$STEPS"
}

seconds_left() { echo $((BUDGET - SECONDS)); }

limit() { # cap [reserve]: a step's timeout: at most cap, and at most what is left after reserve seconds
    # for the steps after it and 10 s for the summary
    local left=$(($(seconds_left) - 10 - ${2:-0}))
    echo $((left < $1 ? left : $1))
}

# run_step NAME LIMIT_S LOG NOTE CMD...: run CMD under timeout, output to LOG, one line in steps.tsv.
run_step() {
    local name=$1 limit=$2 log=$3 note=$4
    shift 4
    if ((limit < 5)); then
        record "$name" SKIPPED - 0 "$log" "no time left in the ${BUDGET}s budget"
        echo "[gpu_check] $name: SKIPPED (no time left)"
        any_failed=1
        return 1
    fi
    echo "[gpu_check] $name (timeout ${limit}s) ..."
    local start=$SECONDS rc status
    timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status=TIMEOUT ;;
        *) status=FAIL ;;
    esac
    record "$name" "$status" "$rc" $((SECONDS - start)) "$log" "$note"
    echo "[gpu_check] $name: $status (rc $rc, $((SECONDS - start))s)"
    if [[ $status != ok ]]; then
        any_failed=1
        tail -n 20 "$log" | sed 's/^/    | /'
    fi
    [[ $status == ok ]]
}

skip_step() { # name reason
    record "$1" SKIPPED - 0 "-" "$2"
    echo "[gpu_check] $1: SKIPPED ($2)"
    any_failed=1
}

step_nvidia_smi() {
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
        >"$LOG_DIR/nvidia-smi.csv" && nvidia-smi
}

# Writes imports.json and prints it; exit 1 when something is missing or CUDA is not usable. A last line
# "MISSING: dist ..." names the pure-Python packages that wheels/ could provide.
# shellcheck disable=SC2089,SC2090  # Python source, passed whole to python -c
IMPORT_CHECK='
import importlib, importlib.util, json, sys
out = sys.argv[1]
# module -> distribution; the last three are not pure Python and must come with the machine.
pure = {"transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
        "xxhash": "xxhash", "typer": "typer", "rich": "rich", "yaml": "pyyaml", "jsonlines": "jsonlines",
        "gguf": "gguf", "numpy": "numpy", "jinja2": "jinja2", "pytest": "pytest"}
system = {"torch": "torch", "triton": "triton"}
report = {"versions": {}, "missing": [], "missing_system": [], "problems": []}
for module, dist in {**system, **pure}.items():
    try:
        report["versions"][dist] = getattr(importlib.import_module(module), "__version__", "?")
    except Exception as e:
        report["versions"][dist] = None
        report["missing_system" if module in system else "missing"].append(dist)
        print(f"cannot import {module} (from {dist}): {type(e).__name__}: {e}")
if importlib.util.find_spec("flash_attn") is not None:
    try:
        report["versions"]["flash-attn"] = importlib.import_module("flash_attn").__version__
    except Exception as e:  # auto would pick it (find_spec) and then fail inside the engine
        report["versions"]["flash-attn"] = None
        report["problems"].append(f"flash_attn is installed but does not import: {type(e).__name__}: {e}")
else:
    report["versions"]["flash-attn"] = None
# optional: the LoRA comparison in tests/gpu builds its adapters with PEFT and skips without it (ship a wheel in wheels/)
report["versions"]["peft"] = getattr(importlib.import_module("peft"), "__version__", "?") \
    if importlib.util.find_spec("peft") is not None else None
if "torch" not in report["missing_system"]:
    import torch
    report["cuda_available"] = torch.cuda.is_available()
    report["torch_cuda"] = torch.version.cuda
    if report["cuda_available"]:
        report["device"] = torch.cuda.get_device_name(0)
        report["bf16"] = torch.cuda.is_bf16_supported()
    else:
        report["problems"].append("torch.cuda.is_available() is False: no usable CUDA device")
if not report["missing"] and not report["missing_system"]:
    try:
        import nanoinfer, nanoinfer.cli, nanoinfer.platforms.cuda.kernels  # the package from src/ and its Triton kernels
        report["nanoinfer"] = nanoinfer.__version__
    except Exception as e:
        report["problems"].append(f"cannot import nanoinfer from src/: {type(e).__name__}: {e}")
if report["missing"]:
    report["problems"].append("missing pure-Python packages: " + " ".join(report["missing"])
                              + " (ship them as wheels in ./wheels; this script installs them with --no-index)")
if report["missing_system"]:
    report["problems"].append("missing: " + " ".join(report["missing_system"])
                              + " (the GPU machine must provide them with CUDA)")
json.dump(report, open(out, "w"), indent=2)
print(json.dumps(report, indent=2))
for problem in report["problems"]:
    print("PROBLEM:", problem)
if report["missing"]:
    print("MISSING:", " ".join(report["missing"]))
sys.exit(1 if report["problems"] else 0)
'

step_imports() {
    local output missing
    output=$("$PY" -c "$IMPORT_CHECK" "$LOG_DIR/imports.json") && { echo "$output"; return 0; }
    echo "$output"
    missing=$(echo "$output" | sed -n 's/^MISSING: //p')
    [[ -n $missing ]] || return 1
    if [[ ! -d $ROOT/wheels ]]; then
        echo "no wheels/ folder to install $missing from (and no network here): ship them as wheels in ./wheels"
        return 1
    fi
    echo "installing from $ROOT/wheels, no index: $missing"
    # shellcheck disable=SC2086  # one word per package
    "$PY" -m pip install --no-index --find-links "$ROOT/wheels" $missing || return 1
    "$PY" -c "$IMPORT_CHECK" "$LOG_DIR/imports.json"
}

step_pytest() {
    # No -m gpu: tests/kernels is not marked gpu (its tests run everywhere, interpreted on CPU), and every
    # test in tests/gpu is. An explicit TRITON_INTERPRET=0 wins over tests/kernels/conftest.py's setdefault.
    # shellcheck disable=SC2086  # one word per path
    TRITON_INTERPRET=0 "$PY" -m pytest $TESTS -q -rs -p no:cacheprovider \
        -o junit_family=xunit2 --junitxml="$LOG_DIR/pytest.xml"
}

step_plan_memory() {
    "$PY" -m nanoinfer plan-memory --model configs/models/qwen3-0.6b --json >"$LOG_DIR/plan-memory.json"
}

step_small_ops_ab() { # the bench's workload flags
    NANOINFER_TORCH_SMALL_OPS=1 "$PY" -m nanoinfer bench --model configs/models/qwen3-0.6b \
        --output-json "$LOG_DIR/bench-torch-small-ops.json" "$@"
}

step_bench() { # extra flags for the workload
    # The model is the CUDA default, named so that nothing can fall back to a download.
    local peer=(--compare hf)
    [[ $COMPARE == off ]] && peer=()
    "$PY" -m nanoinfer bench --model configs/models/qwen3-0.6b ${peer[@]+"${peer[@]}"} \
        --output-json "$LOG_DIR/bench.json" "$@"
}

step_bench_fp8() { # the bench's workload flags
    "$PY" -m nanoinfer bench --model configs/models/qwen3-0.6b --kv-cache-dtype fp8 \
        --output-json "$LOG_DIR/bench-fp8.json" "$@"
}

step_decode_variants() {
    "$PY" "$ROOT/benchmarks/tools/decode_variants.py" --output-json "$LOG_DIR/decode-variants.json"
}

# shellcheck disable=SC2090
export IMPORT_CHECK
export -f step_nvidia_smi step_imports step_pytest step_plan_memory step_bench step_small_ops_ab
export -f step_bench_fp8 step_decode_variants

run_step nvidia-smi 30 "$LOG_DIR/nvidia-smi.log" "" bash -c step_nvidia_smi
if run_step imports 120 "$LOG_DIR/imports.log" "" bash -c step_imports; then
    # Reserve plan-memory's cap and the small bench's time, so a slow test run cannot crowd out the bench.
    run_step pytest "$(limit 210 $((60 + BENCH_SMALL_MIN_S)))" "$LOG_DIR/pytest.log" "" bash -c step_pytest
    run_step plan-memory "$(limit 60)" "$LOG_DIR/plan-memory.log" "" bash -c step_plan_memory
    ab_reserve=$([[ $SMALL_OPS_AB == off ]] && echo 0 || echo "$AB_RESERVE_S")
    if [[ $VARIANTS == off ]]; then
        record decode-variants off - 0 "-" "GPU_CHECK_VARIANTS=off"
    else
        run_step decode-variants "$(limit "$VARIANTS_MAX_S" $((BENCH_SMALL_MIN_S + ab_reserve)))" \
            "$LOG_DIR/decode-variants.log" "" bash -c step_decode_variants
    fi
    left=$(($(seconds_left) - 10 - ab_reserve))
    case $BENCH_MODE in
        full) bench_flags=() note="full workload" ;;
        small) bench_flags=("${SMALL_BENCH[@]}") note="small workload (GPU_CHECK_BENCH=small)" ;;
        off) bench_flags=() note="off" ;;
        *)
            if ((left >= BENCH_FULL_MIN_S)); then
                bench_flags=() note="full workload"
            elif ((left >= BENCH_SMALL_MIN_S)); then
                bench_flags=("${SMALL_BENCH[@]}") note="small workload: ${left}s left, full needs ${BENCH_FULL_MIN_S}s"
            else
                bench_flags=() note="skip"
            fi
            ;;
    esac
    if [[ $note == off ]]; then
        record bench off - 0 "-" "GPU_CHECK_BENCH=off"
    elif [[ $note == skip ]]; then
        skip_step bench "${left}s left, the small workload needs ${BENCH_SMALL_MIN_S}s"
    else
        if run_step bench "$left" "$LOG_DIR/bench.log" "$note" bash -c 'step_bench "$@"' _ \
            ${bench_flags[@]+"${bench_flags[@]}"}; then
            fp8_left=$(($(seconds_left) - 10 - ab_reserve))
            if [[ $FP8_BENCH != off ]] && ((fp8_left >= FP8_BENCH_MIN_S)); then
                run_step bench-fp8 "$(limit 150 "$ab_reserve")" "$LOG_DIR/bench-fp8.log" "fp8 KV cache, same workload" \
                    bash -c 'step_bench_fp8 "$@"' _ ${bench_flags[@]+"${bench_flags[@]}"}
            elif [[ $FP8_BENCH != off ]]; then
                record bench-fp8 off - 0 "-" "${fp8_left}s left, it needs ${FP8_BENCH_MIN_S}s"
            fi
            if [[ $SMALL_OPS_AB != off ]]; then
                run_step small-ops-ab "$(limit 150)" "$LOG_DIR/small-ops-ab.log" "torch's small ops, same workload" \
                    bash -c 'step_small_ops_ab "$@"' _ ${bench_flags[@]+"${bench_flags[@]}"}
            fi
        fi
    fi
else
    for step in pytest plan-memory decode-variants bench; do
        skip_step "$step" "the imports step failed"
    done
fi

"$PY" "$ROOT/scripts/gpu_check_summary.py" "$LOG_DIR" | tee "$LOG_DIR/summary.txt"
summary_rc=${PIPESTATUS[0]}
if ((any_failed || summary_rc)); then
    exit 1
fi
exit 0
