"""The parts of scripts/gpu_check.sh that run without a GPU: its syntax, that it never reaches for the network,
the closing table (scripts/gpu_check_summary.py) on fixture logs, and a whole run on a machine without CUDA,
which must stop after the imports step, print the table and exit non-zero."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SUMMARY = ROOT / "scripts" / "gpu_check_summary.py"
HEADER = "step\tstatus\trc\tseconds\tlog\tnote\n"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def write_steps(log_dir: Path, rows: list[tuple]) -> None:
    lines = ["\t".join(str(cell) for cell in row) for row in rows]
    (log_dir / "steps.tsv").write_text(HEADER + "".join(line + "\n" for line in lines))


def write_passing_logs(log_dir: Path, *, engine_blocks: int = 12_000, plan_blocks: int = 12_100) -> None:
    """What a passing run leaves behind, with the numbers the table must pick out."""
    write_steps(
        log_dir,
        [
            ("nvidia-smi", "ok", 0, 1, "nvidia-smi.log", ""),
            ("imports", "ok", 0, 14, "imports.log", ""),
            ("pytest", "ok", 0, 95, "pytest.log", ""),
            ("plan-memory", "ok", 0, 6, "plan-memory.log", ""),
            ("bench", "ok", 0, 180, "bench.log", "full workload"),
        ],
    )
    (log_dir / "nvidia-smi.csv").write_text("NVIDIA H200, 143771 MiB, 0 MiB, 550.90.07\n")
    imports = {
        "versions": {"torch": "2.5.1+cu124", "triton": "3.1.0", "transformers": "4.57.1", "flash-attn": None},
        "missing": [], "missing_system": [], "problems": [], "cuda_available": True, "torch_cuda": "12.4",
    }  # fmt: skip
    (log_dir / "imports.json").write_text(json.dumps(imports))
    (log_dir / "pytest.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
        'skipped="7" tests="62" time="80.1">'
        '<testcase classname="gpu" name="test_cuda_graph_decode_matches_eager[triton-float32]"/>'
        '<testcase classname="gpu" name="test_cuda_graph_decode_matches_eager[triton-bfloat16]"/>'
        '<testcase classname="gpu" name="test_cuda_graph_decode_matches_eager[flash-attn-bfloat16]">'
        '<skipped message="flash-attn is not installed"/></testcase>'
        '<testcase classname="gpu" name="test_cuda_graphs_fit_in_the_plan"/>'
        '</testsuite></testsuites>'
    )
    (log_dir / "plan-memory.json").write_text(
        json.dumps({"num_blocks": plan_blocks, "kvcache_block_size": 256, "kv_bytes": 110 * 2**30, "fits": True})
    )
    bench = {
        "workload": {"num_requests": 256},
        "engine": {"num_kvcache_blocks": engine_blocks},
        "runs": [
            {"engine": "nanoinfer", "output_tok_s": 12345.6},
            {"engine": "hf-transformers", "output_tok_s": 3456.7},
        ],
        "ratio": {"peer": "hf-transformers", "output_tok_s": 12345.6 / 3456.7},
    }
    (log_dir / "bench.json").write_text(json.dumps(bench))


def summarize(log_dir: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(SUMMARY), str(log_dir)], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return result


def row(output: str, step: str) -> str:
    """The table line of `step` (the first column)."""
    lines = [line for line in output.splitlines() if re.match(rf"{re.escape(step)}\s{{2,}}", line)]
    assert len(lines) == 1, output
    return lines[0]


# --- the shell script ---------------------------------------------------------------------------------------


@needs_bash
def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_script_installs_only_from_local_wheels_and_runs_offline():
    text = SCRIPT.read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    pip_lines = [line for line in code if re.search(r"\bpip3?\b", line) and "PIP_" not in line]
    assert pip_lines, "the wheels/ fallback should be the one pip call"
    for line in pip_lines:
        assert "--no-index" in line and '--find-links "$ROOT/wheels"' in line, line
        assert not re.search(r"--(extra-)?index-url|\bdownload\b", line), line
    assert "export PIP_NO_INDEX=1" in text
    assert "HF_HUB_OFFLINE=1" in text and "TRANSFORMERS_OFFLINE=1" in text
    for fetcher in ("curl ", "wget ", "git clone", "huggingface-cli", "hf download", "snapshot_download"):
        assert fetcher not in text, fetcher


def test_script_runs_the_kernel_tests_compiled_and_every_step_under_a_timeout():
    text = SCRIPT.read_text()
    assert "TRITON_INTERPRET=0" in text and "tests/gpu tests/kernels" in text
    assert "timeout --kill-after" in text
    assert "--output-json" in text and "--compare hf" in text
    assert "plan-memory --model configs/models/qwen3-0.6b --json" in text


@needs_bash
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with CUDA the script runs every step (minutes)")
def test_script_without_cuda_stops_after_imports_prints_the_table_and_fails(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_LOG_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "FAIL" in row(out, "imports") and "torch.cuda.is_available() is False" in row(out, "imports")
    for step in ("pytest", "plan-memory", "decode-variants", "bench"):
        assert "SKIPPED" in row(out, step) and "the imports step failed" in row(out, step)
    assert "n/a" in row(out, "cuda graphs") and "no CUDA-graph test results" in row(out, "cuda graphs")
    assert out.rstrip().splitlines()[-1] == f"logs: {tmp_path}"  # the table comes last
    assert (tmp_path / "summary.txt").read_text() in out
    imports = json.loads((tmp_path / "imports.json").read_text())
    assert imports["missing"] == [] and imports["cuda_available"] is False
    assert "Traceback" not in out + result.stderr


# --- the summary table ----------------------------------------------------------------------------------


def test_summary_picks_the_key_number_of_every_step(tmp_path):
    write_passing_logs(tmp_path)
    result = summarize(tmp_path)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert out.splitlines()[0].split() == ["step", "status", "key", "number", "seconds"]
    assert row(out, "nvidia-smi").split()[1] == "ok"
    assert "NVIDIA H200, 143771 MiB (0 MiB used), driver 550.90.07" in row(out, "nvidia-smi")
    assert "torch 2.5.1+cu124 (CUDA 12.4), triton 3.1.0" in row(out, "imports")
    assert "flash-attn absent" in row(out, "imports")
    assert "55 passed, 7 skipped" in row(out, "pytest") and row(out, "pytest").endswith(" 95")
    assert "12,100 blocks x 256 tokens, 110.0 GiB KV" in row(out, "plan-memory")
    bench = row(out, "bench")
    assert "nanoinfer 12,346 out tok/s vs HF 3,457: 3.57x, 256 requests [full workload]" in bench
    assert "target" not in bench  # above the 3x target
    assert "plan-memory 12,100 vs engine 12,000 blocks (+0.8%)" in row(out, "planner vs engine")
    assert row(out, "planner vs engine").split()[3] == "ok"
    assert "graph vs eager + memory plan: 3 passed, 1 skipped" in row(out, "cuda graphs")
    assert row(out, "cuda graphs").split()[2] == "ok"
    assert row(out, "total").split()[1] == "ok" and row(out, "total").endswith(" 296")


def test_summary_fails_and_names_a_failed_or_timed_out_step(tmp_path):
    write_passing_logs(tmp_path)
    (tmp_path / "pytest.xml").unlink()
    (tmp_path / "pytest.log").write_text("FAILED tests/gpu/test_cuda_engine.py::test_x\n2 failed, 53 passed in 9s\n")
    (tmp_path / "bench.log").write_text("running nanoinfer ...\n")
    write_steps(
        tmp_path,
        [
            ("pytest", "FAIL", 1, 95, "pytest.log", ""),
            ("bench", "TIMEOUT", 124, 300, "bench.log", "full workload"),
        ],
    )
    result = summarize(tmp_path)
    assert result.returncode == 1
    assert "FAIL (rc 1)" in row(result.stdout, "pytest")
    assert "53 passed, 2 failed" in row(result.stdout, "pytest")  # from the log when there is no XML
    assert "TIMEOUT (rc 124)" in row(result.stdout, "bench")
    assert "failed: pytest, bench" in row(result.stdout, "total")


def test_summary_shows_the_last_log_line_of_a_failed_step_without_numbers(tmp_path):
    write_steps(tmp_path, [("plan-memory", "FAIL", 2, 3, "plan-memory.log", "")])
    (tmp_path / "plan-memory.log").write_text("Traceback ...\nError: model path x is not a directory.\n\n")
    result = summarize(tmp_path)
    assert result.returncode == 1
    assert "Error: model path x is not a directory." in row(result.stdout, "plan-memory")


def test_summary_flags_a_planner_gap_over_two_percent_without_failing(tmp_path):
    write_passing_logs(tmp_path, engine_blocks=10_000, plan_blocks=10_500)
    result = summarize(tmp_path)
    assert result.returncode == 0
    line = row(result.stdout, "planner vs engine")
    assert line.split()[3] == "WARN" and "(+5.0%)" in line


def test_summary_marks_a_ratio_below_the_3x_target(tmp_path):
    write_passing_logs(tmp_path)
    bench = json.loads((tmp_path / "bench.json").read_text())
    bench["ratio"]["output_tok_s"] = 2.5
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert "2.50x (target 3x)" in row(summarize(tmp_path).stdout, "bench")


def test_summary_reports_a_failed_cuda_graph_test(tmp_path):
    write_passing_logs(tmp_path)
    xml = (tmp_path / "pytest.xml").read_text().replace(
        'name="test_cuda_graphs_fit_in_the_plan"/>',
        'name="test_cuda_graphs_fit_in_the_plan"><failure message="used 71.2 GiB"/></testcase>',
    )
    (tmp_path / "pytest.xml").write_text(xml)
    out = summarize(tmp_path).stdout
    assert row(out, "cuda graphs").split()[2] == "FAIL"
    assert "2 passed, 1 failed, 1 skipped" in row(out, "cuda graphs")


def test_summary_survives_missing_and_truncated_files(tmp_path):
    write_passing_logs(tmp_path)
    (tmp_path / "bench.json").write_text('{"runs": [')  # killed while writing
    (tmp_path / "plan-memory.json").unlink()
    (tmp_path / "pytest.xml").write_text("<testsuites")
    (tmp_path / "nvidia-smi.csv").unlink()
    result = summarize(tmp_path)
    assert result.returncode == 0  # the steps said ok; only the numbers are gone
    assert row(result.stdout, "bench").split()[1:4] == ["ok", "full", "workload"]  # the note, no numbers
    assert row(result.stdout, "plan-memory").split()[1:3] == ["ok", "-"]
    assert row(result.stdout, "nvidia-smi").split()[1:3] == ["ok", "-"]
    assert row(result.stdout, "pytest").split()[1:3] == ["ok", "-"]
    assert "planner vs engine" not in result.stdout
    assert "no CUDA-graph test results" in row(result.stdout, "cuda graphs")


def test_summary_without_steps_file_says_what_to_run(tmp_path):
    result = summarize(tmp_path)
    assert result.returncode == 1
    assert "did scripts/gpu_check.sh run?" in result.stdout


def test_summary_counts_a_disabled_bench_as_off_not_failed(tmp_path):
    write_passing_logs(tmp_path)
    write_steps(
        tmp_path, [("imports", "ok", 0, 10, "imports.log", ""), ("bench", "off", "-", 0, "-", "GPU_CHECK_BENCH=off")]
    )
    result = summarize(tmp_path)
    assert result.returncode == 0
    assert row(result.stdout, "bench").split()[1:3] == ["off", "GPU_CHECK_BENCH=off"]  # no stale numbers


def test_summary_gives_the_small_ops_speed_up_from_the_second_bench(tmp_path):
    """The A/B step: the bench's nanoinfer run (Triton small ops) against the same workload with torch's."""
    write_passing_logs(tmp_path)
    with (tmp_path / "steps.tsv").open("a") as steps:
        steps.write("small-ops-ab\tok\t0\t60\tsmall-ops-ab.log\ttorch's small ops, same workload\n")
    torch_ops = {"runs": [{"engine": "nanoinfer", "output_tok_s": 10000.0}]}
    (tmp_path / "bench-torch-small-ops.json").write_text(json.dumps(torch_ops))
    out = summarize(tmp_path).stdout
    assert "Triton small ops 12,346 vs torch's 10,000 out tok/s: 1.23x" in row(out, "small-ops-ab")
    (tmp_path / "bench-torch-small-ops.json").write_text("{")  # cut off mid-write: no number, no traceback
    assert "tok/s" not in row(summarize(tmp_path).stdout, "small-ops-ab")


def test_script_keeps_time_for_the_small_ops_ab_and_lets_it_be_turned_off():
    text = SCRIPT.read_text()
    assert "NANOINFER_TORCH_SMALL_OPS=1" in text and "GPU_CHECK_SMALL_OPS_AB" in text
    assert "left=$(($(seconds_left) - 10 - ab_reserve))" in text


# --- issue 39: the roofline, the decode variants, the fp8 bench ----------------------------------------------


def test_script_measures_the_decode_variants_and_an_fp8_bench_and_can_leave_out_the_peer():
    text = SCRIPT.read_text()
    assert "benchmarks/tools/decode_variants.py" in text and "GPU_CHECK_VARIANTS" in text
    assert "--kv-cache-dtype fp8" in text and "GPU_CHECK_FP8_BENCH" in text
    assert "GPU_CHECK_COMPARE" in text and '[[ $COMPARE == off ]] && peer=()' in text
    # The variants never eat into the small bench's time (nor the A/B's).
    assert 'limit "$VARIANTS_MAX_S" $((BENCH_SMALL_MIN_S + ab_reserve))' in text


def write_issue_39_logs(log_dir: Path, *, decode_share: float = 0.55) -> None:
    write_passing_logs(log_dir)
    with (log_dir / "steps.tsv").open("a") as steps:
        steps.write("decode-variants\tok\t0\t110\tdecode-variants.log\t\n")
        steps.write("bench-fp8\tok\t0\t40\tbench-fp8.log\tfp8 KV cache, same workload\n")
    bench = json.loads((log_dir / "bench.json").read_text())
    bench["roofline"] = {
        "ceilings": {"bandwidth_source": "H200 datasheet"},
        "classes": {"prefill": {"of_floor": 0.4}, "decode 65-128": {"of_floor": 0.5},
                    "decode 129-256": {"of_floor": decode_share}},
        "all_steps": {"of_floor": 0.31},
    }  # fmt: skip
    (log_dir / "bench.json").write_text(json.dumps(bench))
    (log_dir / "bench-fp8.json").write_text(json.dumps({"runs": [{"engine": "nanoinfer", "output_tok_s": 15432.1}]}))
    variants = {
        "shapes": ["1x512", "256x2048"], "all_ok": True,
        "winners": {
            "bfloat16 1x512": {"variant": "splits16", "of_floor": 0.2, "default_of_floor": 0.1},
            "bfloat16 256x2048": {"variant": "tile128-warps8", "of_floor": 0.74, "default_of_floor": 0.52},
            "fp8_e4m3 256x2048": {"variant": "default", "of_floor": 0.61, "default_of_floor": 0.61},
        },
    }  # fmt: skip
    (log_dir / "decode-variants.json").write_text(json.dumps(variants))


def test_summary_gives_the_roofline_the_variants_winners_and_the_fp8_speed_up(tmp_path):
    write_issue_39_logs(tmp_path)
    out = summarize(tmp_path).stdout
    variants = row(out, "decode-variants")
    assert "256x2048 best of HBM floor: bfloat16 tile128-warps8 74% (default 52%), fp8_e4m3 default 61%" in variants
    assert "fp8 cache 15,432 out tok/s vs bf16 12,346: 1.25x" in row(out, "bench-fp8")
    roofline = row(out, "roofline")
    assert roofline.split()[1] == "WARN"  # below the issue's 70% at full batch, informational
    assert "decode 129-256: 55% of floor (target 70%); all steps at 31% of their floor [H200 datasheet]" in roofline
    assert row(out, "total").split()[1] == "ok"

    write_issue_39_logs(tmp_path, decode_share=0.8)
    roofline = row(summarize(tmp_path).stdout, "roofline")
    assert roofline.split()[1] == "ok" and "decode 129-256: 80% of floor; all steps" in roofline


def test_summary_says_when_a_variant_did_not_match_and_survives_missing_files(tmp_path):
    write_issue_39_logs(tmp_path)
    variants = json.loads((tmp_path / "decode-variants.json").read_text())
    (tmp_path / "decode-variants.json").write_text(json.dumps({**variants, "all_ok": False}))
    assert "a variant did not match the default" in row(summarize(tmp_path).stdout, "decode-variants")
    for name in ("decode-variants.json", "bench-fp8.json"):
        (tmp_path / name).write_text("{")  # cut off mid-write
    out = summarize(tmp_path).stdout
    assert row(out, "decode-variants").split()[1:3] == ["ok", "-"]
    assert "tok/s" not in row(out, "bench-fp8")


def test_decode_variants_tool_runs_its_smoke_check_on_cpu(tmp_path):
    """The tool's whole path (cache, tables, each variant checked against the default, the table, the winners,
    the JSON) under Triton's interpreter on tiny shapes; its timings there mean nothing and are not checked."""
    out = tmp_path / "variants.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/tools/decode_variants.py"), "--smoke",
                             "--output-json", str(out)], capture_output=True, text=True, env=env,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "nanoinfer-decode-variants/1" and report["all_ok"] is True
    assert {r["cache"] for r in report["results"]} == {"bfloat16", "fp8_e4m3"}
    assert {r["variant"] for r in report["results"]} == {"default", "tile32", "by-seq-len-splits8"}
    assert all(r["ok"] and r["us"] > 0 and r["floor_us"] > 0 for r in report["results"])
    assert set(report["winners"]) == {"bfloat16 2x300", "fp8_e4m3 2x300"}
    assert "winner bfloat16 2x300:" in result.stdout
