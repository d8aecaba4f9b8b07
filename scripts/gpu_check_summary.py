"""The table scripts/gpu_check.sh prints last: one row per step (status, key number, seconds), read from what
the steps left in the log folder. Standard library only, so it runs even when torch does not import.

Usage: python scripts/gpu_check_summary.py LOG_DIR    (exit 1 when a step failed, timed out or was skipped)

LOG_DIR/steps.tsv (written by gpu_check.sh) has a header and one line per step:
    step  status (ok|FAIL|TIMEOUT|SKIPPED|off)  rc  seconds  log  note
Key numbers come from nvidia-smi.csv, imports.json, pytest.xml (else pytest.log), plan-memory.json, bench.json,
bench-torch-small-ops.json, decode-variants.json and bench-fp8.json; the roofline row from bench.json's roofline.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FAILED_STATUSES = {"FAIL", "TIMEOUT", "SKIPPED"}
PLANNER_TOLERANCE = 0.02  # issue 6: planner vs actual block count within 2%
BENCH_TARGET_RATIO = 3.0  # issue 6: at least 3x HF's batched generate
DECODE_FLOOR_TARGET = 0.70  # issue 39: decode steps at full batch at 70% or more of their HBM floor


def read_steps(log_dir: Path) -> list[dict]:
    lines = (log_dir / "steps.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:] if line.strip()]


def read_json(path: Path):
    """The parsed file, or None when it is missing or not JSON (a step that died half-way)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def key_nvidia_smi(log_dir: Path) -> str:
    try:
        first = (log_dir / "nvidia-smi.csv").read_text().strip().splitlines()[0]
    except (OSError, IndexError):
        return "-"
    fields = [f.strip() for f in first.split(",")]
    if len(fields) != 4:
        return first
    name, total, used, driver = fields
    return f"{name}, {total} ({used} used), driver {driver}"


def key_imports(log_dir: Path) -> str:
    report = read_json(log_dir / "imports.json")
    if not isinstance(report, dict):
        return "-"
    versions = report.get("versions", {})
    if report.get("missing") or report.get("missing_system"):
        return "missing: " + " ".join(report.get("missing_system", []) + report.get("missing", []))
    if report.get("problems"):
        return report["problems"][0][:100]
    cuda = f"CUDA {report['torch_cuda']}" if report.get("torch_cuda") else "no CUDA build"
    flash = versions.get("flash-attn") or "absent"
    return (
        f"torch {versions.get('torch')} ({cuda}), triton {versions.get('triton')}, "
        f"transformers {versions.get('transformers')}, flash-attn {flash}"
    )


def key_pytest(log_dir: Path) -> str:
    counts = _junit_counts(log_dir / "pytest.xml") or _pytest_log_counts(log_dir / "pytest.log")
    if counts is None:
        return "-"
    order = ("passed", "failed", "errors", "skipped")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k) or k == "passed")


def _junit_counts(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
    }  # fmt: skip


def _pytest_log_counts(path: Path) -> dict | None:
    """From pytest's last line, e.g. "41 passed, 3 skipped, 1 warning in 80.1s"."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", line)
        if found:
            counts = {"errors" if word.startswith("error") else word: int(n) for n, word in found}
            return {"passed": 0, **counts}
    return None


def key_plan_memory(log_dir: Path) -> str:
    report = read_json(log_dir / "plan-memory.json")
    if not isinstance(report, dict) or "num_blocks" not in report:
        return "-"
    text = (
        f"{report['num_blocks']:,} blocks x {report.get('kvcache_block_size', '?')} tokens, "
        f"{report.get('kv_bytes', 0) / 2**30:.1f} GiB KV"
    )
    return text if report.get("fits", True) else text + ", does not fit"


def _bench_runs(report: dict) -> dict:
    return {run.get("engine"): run for run in report.get("runs", []) if isinstance(run, dict)}


def key_bench(log_dir: Path) -> str:
    report = read_json(log_dir / "bench.json")
    if not isinstance(report, dict):
        return "-"
    runs = _bench_runs(report)
    ours, hf = runs.get("nanoinfer"), runs.get("hf-transformers")
    if ours is None:
        return "-"
    text = f"nanoinfer {ours['output_tok_s']:,.0f} out tok/s"
    ratio = (report.get("ratio") or {}).get("output_tok_s")
    if hf is not None and ratio is not None:
        text += f" vs HF {hf['output_tok_s']:,.0f}: {ratio:.2f}x"
        text += "" if ratio >= BENCH_TARGET_RATIO else f" (target {BENCH_TARGET_RATIO:g}x)"
    requests = (report.get("workload") or {}).get("num_requests")
    return text + (f", {requests} requests" if requests else "")


def key_small_ops_ab(log_dir: Path) -> str:
    """The bench's nanoinfer run (Triton small ops) against the same workload with torch's small ops."""
    triton_run = _bench_runs(read_json(log_dir / "bench.json") or {}).get("nanoinfer")
    torch_run = _bench_runs(read_json(log_dir / "bench-torch-small-ops.json") or {}).get("nanoinfer")
    try:
        triton_rate, torch_rate = float(triton_run["output_tok_s"]), float(torch_run["output_tok_s"])
    except (TypeError, KeyError, ValueError):
        return "-"
    return (f"Triton small ops {triton_rate:,.0f} vs torch's {torch_rate:,.0f} out tok/s: "
            f"{triton_rate / torch_rate:.2f}x")  # fmt: skip


def key_bench_fp8(log_dir: Path) -> str:
    """The fp8 cache's run of the bench's workload against the bench's own (bfloat16 cache)."""
    bf16 = _bench_runs(read_json(log_dir / "bench.json") or {}).get("nanoinfer")
    fp8 = _bench_runs(read_json(log_dir / "bench-fp8.json") or {}).get("nanoinfer")
    try:
        fp8_rate = float(fp8["output_tok_s"])
    except (TypeError, KeyError, ValueError):
        return "-"
    text = f"fp8 cache {fp8_rate:,.0f} out tok/s"
    try:
        bf16_rate = float(bf16["output_tok_s"])
    except (TypeError, KeyError, ValueError):
        return text
    return text + f" vs bf16 {bf16_rate:,.0f}: {fp8_rate / bf16_rate:.2f}x"


def key_decode_variants(log_dir: Path) -> str:
    """The largest shape's winner per cache dtype, against the default kernel, as shares of the HBM floor."""
    report = read_json(log_dir / "decode-variants.json")
    if not isinstance(report, dict) or not report.get("winners") or not report.get("shapes"):
        return "-"
    largest = report["shapes"][-1]
    parts = []
    for key, winner in report["winners"].items():
        cache, shape = key.rsplit(" ", 1)
        if shape != largest:
            continue
        try:
            part = f"{cache} {winner['variant']} {winner['of_floor']:.0%}"
            if winner.get("default_of_floor") is not None and winner["variant"] != "default":
                part += f" (default {winner['default_of_floor']:.0%})"
        except (KeyError, TypeError, ValueError):
            continue
        parts.append(part)
    text = f"{largest} best of HBM floor: " + ", ".join(parts) if parts else "-"
    return text if report.get("all_ok", True) else text + "; a variant did not match the default"


def roofline_row(log_dir: Path) -> tuple[str, str, str, str] | None:
    """The bench's roofline: decode at its largest batch class and all steps, as floor / time. WARN below the
    issue's 70% at full batch (informational: the bench step itself passed)."""
    report = read_json(log_dir / "bench.json")
    try:
        roofline = report["roofline"]
        classes = roofline["classes"]
        decode = [name for name in classes if name.startswith("decode")]
        all_steps = float(roofline["all_steps"]["of_floor"])
    except (TypeError, KeyError, ValueError):
        return None
    text = f"all steps at {all_steps:.0%} of their floor"
    status = "ok"
    if decode:
        largest = decode[-1]  # classes come in order: prefill, then decode by batch size
        share = classes[largest].get("of_floor")
        if isinstance(share, (int, float)):
            status = "ok" if share >= DECODE_FLOOR_TARGET else "WARN"
            target = "" if status == "ok" else f" (target {DECODE_FLOOR_TARGET:.0%})"
            text = f"{largest}: {share:.0%} of floor{target}; {text}"
    source = (roofline.get("ceilings") or {}).get("bandwidth_source")
    return ("roofline", status, text + (f" [{source}]" if source else ""), "-")


def planner_row(log_dir: Path) -> tuple[str, str, str, str] | None:
    """plan-memory's estimate against the blocks the bench's engine allocated (same model and defaults).
    Informational: plan-memory estimates the activation peak that the engine measures."""
    plan, bench = read_json(log_dir / "plan-memory.json"), read_json(log_dir / "bench.json")
    try:
        planned = int(plan["num_blocks"])
        actual = int(bench["engine"]["num_kvcache_blocks"])
    except (TypeError, KeyError, ValueError):
        return None
    if actual <= 0:
        return None
    gap = (planned - actual) / actual
    status = "ok" if abs(gap) <= PLANNER_TOLERANCE else "WARN"
    return ("planner vs engine", status, f"plan-memory {planned:,} vs engine {actual:,} blocks ({gap:+.1%})", "-")


def last_line(path: Path, width: int = 90) -> str:
    """The last non-empty line of a step's log: what a failed step said last."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "-"
    if not lines:
        return "-"
    return lines[-1] if len(lines[-1]) <= width else lines[-1][: width - 3] + "..."


KEYS = {
    "nvidia-smi": key_nvidia_smi,
    "imports": key_imports,
    "pytest": key_pytest,
    "plan-memory": key_plan_memory,
    "bench": key_bench,
    "small-ops-ab": key_small_ops_ab,
    "decode-variants": key_decode_variants,
    "bench-fp8": key_bench_fp8,
}


def build_rows(log_dir: Path, steps: list[dict]) -> list[tuple[str, str, str, str]]:
    rows = []
    for step in steps:
        name, status = step.get("step", "?"), step.get("status", "?")
        if status in FAILED_STATUSES - {"SKIPPED"} and step.get("rc") not in (None, "", "-"):
            status = f"{status} (rc {step['rc']})"
        ran = step.get("status") not in ("SKIPPED", "off")  # else any file of its is from an earlier run
        key = KEYS[name](log_dir) if name in KEYS and ran else ""
        if step.get("status") in FAILED_STATUSES - {"SKIPPED"} and key in ("", "-"):
            key = last_line(log_dir / step.get("log", "-"))
        note = step.get("note", "")
        if note:
            key = f"{key} [{note}]" if key and key != "-" else note
        rows.append((name, status, key or "-", step.get("seconds", "-")))
    planner = planner_row(log_dir)
    if planner is not None:
        rows.append(planner)
    bench_ran = any(s.get("step") == "bench" and s.get("status") not in ("SKIPPED", "off") for s in steps)
    roofline = roofline_row(log_dir) if bench_ran else None
    if roofline is not None:
        rows.append(roofline)
    rows.append(graphs_row(log_dir))
    return rows


def graphs_row(log_dir: Path) -> tuple[str, str, str, str]:
    """The CUDA-graph tests of tests/gpu (graph vs eager, graphs within the memory plan), from pytest.xml.
    Informational: a failure there already fails the pytest step."""
    try:
        cases = [c for c in ET.parse(log_dir / "pytest.xml").getroot().iter("testcase")
                 if c.get("name", "").startswith("test_cuda_graph")]  # fmt: skip
    except (OSError, ET.ParseError):
        cases = []
    if not cases:
        return ("cuda graphs", "n/a", "no CUDA-graph test results in pytest.xml", "-")
    outcome = {"failed": 0, "skipped": 0}
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"] += 1
        elif case.find("skipped") is not None:
            outcome["skipped"] += 1
    passed = len(cases) - outcome["failed"] - outcome["skipped"]
    status = "FAIL" if outcome["failed"] else ("ok" if passed else "n/a")
    text = f"graph vs eager + memory plan: {passed} passed" + "".join(
        f", {n} {k}" for k, n in outcome.items() if n
    )
    return ("cuda graphs", status, text, "-")


def format_table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("step", "status", "key number", "seconds")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(4)]

    def line(row) -> str:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths)]
        cells[3] = str(row[3]).rjust(widths[3])
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *map(line, rows)])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    log_dir = Path(argv[0])
    try:
        steps = read_steps(log_dir)
    except (OSError, IndexError) as e:
        print(f"gpu_check summary: cannot read {log_dir / 'steps.tsv'} ({e}); did scripts/gpu_check.sh run?")
        return 1
    failed = [s["step"] for s in steps if s.get("status") in FAILED_STATUSES]
    total = sum(int(s["seconds"]) for s in steps if s.get("seconds", "").isdigit())
    rows = build_rows(log_dir, steps)
    rows.append(("total", "FAILED" if failed else "ok", f"failed: {', '.join(failed)}" if failed else "", str(total)))
    meta = log_dir / "meta.txt"
    if meta.is_file():
        print("gpu_check: " + "; ".join(meta.read_text().split("\n")).strip("; "))
    print(format_table(rows))
    print(f"logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
