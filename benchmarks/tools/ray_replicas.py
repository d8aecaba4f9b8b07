"""--data-parallel-size on one machine: 2 replicas x 1 thread (Ray) against 1 engine x 2 threads, and the
driver's CPU time per 1,000 records.

Each run is a fresh `nanoinfer generate` process (a fresh local Ray instance for the replicas), on workload W's
shape by default (64 requests of random token ids, 32..256 prompt and 32..256 output tokens, greedy, EOS
ignored, seed 0) and the built-in default model; the two configurations alternate for --rounds rounds, so a
drift of the shared machine hits both. Then --overhead-lines one-token requests go through the replicas: the
engines have little to do, so the driver's CPU time in its loop (parse, hand out, collect, write; Ray's
client threads included, its startup not) per 1,000 records is what a cluster's driver would pay per record.
Both configurations must write the same greedy records; the script says whether they did.

    python benchmarks/tools/ray_replicas.py                              # the default model, 2 rounds
    python benchmarks/tools/ray_replicas.py --output-json benchmarks/results/cpu-ray-replicas.json
    python benchmarks/tools/ray_replicas.py --model /tmp/tiny --num-requests 8 --overhead-lines 200 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name -> generate flags
    "1 engine x 2 threads": ["--num-threads", "2"],
    "2 replicas x 1 thread": ["--data-parallel-size", "2", "--num-threads", "1"],
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--overhead-lines", type=int, default=2000, help="one-token requests for the driver's cost")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()

    from nanoinfer.config import DEFAULT_MODEL, Config

    config = Config(model=args.model or DEFAULT_MODEL, device="cpu")  # builds the default model on first use
    vocab = config.hf_config.vocab_size
    work = Path(tempfile.mkdtemp(prefix="nanoinfer-ray-bench-"))
    rng = random.Random(args.seed)
    workload = work / "w.jsonl"
    write_lines(workload, [
        {"id": f"w{i}", "prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))],
         "max_tokens": rng.randint(*args.output_len), "ignore_eos": True} for i in range(args.num_requests)])
    overhead = work / "overhead.jsonl"
    write_lines(overhead, [
        {"id": f"o{i}", "prompt_token_ids": [rng.randrange(vocab) for _ in range(8)], "max_tokens": 1}
        for i in range(args.overhead_lines)])
    common = ["--model", config.model, "--device", "cpu", "--temperature", "0", "--quiet", "--json", "--overwrite"]

    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        for config_index, (name, flags) in enumerate(CONFIGS.items()):
            out = work / f"out-{config_index}-{round_index}.jsonl"
            run = run_child(work, [str(workload), "-o", str(out), *common, *flags])
            run["records"] = records_by_id(out)
            runs[name].append(run)
            print(f"round {round_index + 1}: {name}: {run['summary']['output_tokens_per_s']} output tok/s, "
                  f"{run['wall_s']:.1f} s in all", file=sys.stderr)
    same = all(run["records"] == runs[name][0]["records"] for name in runs for run in runs[name])
    same = same and runs["1 engine x 2 threads"][0]["records"] == runs["2 replicas x 1 thread"][0]["records"]
    driver = None
    if args.overhead_lines:
        out = work / "overhead-out.jsonl"
        driver = run_child(work, [str(overhead), "-o", str(out), *common, *CONFIGS["2 replicas x 1 thread"]])
    report(args, runs, same, driver, config)


def write_lines(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def records_by_id(path: Path) -> dict:
    return {r["id"]: (r["text"], (r["usage"] or {}).get("completion_tokens")) for r in map(json.loads, path.open())}


def run_child(work: Path, generate_args: list[str]) -> dict:
    result = work / "child.json"
    command = [sys.executable, __file__, "--child", str(result), *generate_args]
    subprocess.run(command, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(result.read_text())


def child(result: Path, generate_args: list[str]) -> None:
    """One `nanoinfer generate` in this process, timing the driver's loop (process CPU time: all its threads)."""
    from nanoinfer.cli import app
    from nanoinfer.cli import generate as generate_cli
    from nanoinfer.jobs import ray_replicas

    timings = {}

    def timed(loop):
        def run(*args):
            cpu, wall = time.process_time(), time.monotonic()
            try:
                loop(*args)
            finally:
                timings["loop_cpu_s"] = time.process_time() - cpu
                timings["loop_wall_s"] = time.monotonic() - wall
        return run

    ray_replicas.stream_requests = timed(ray_replicas.stream_requests)
    generate_cli.stream_requests = timed(generate_cli.stream_requests)
    stdout = io.StringIO()
    cpu, wall = time.process_time(), time.monotonic()
    with contextlib.redirect_stdout(stdout):
        app(["generate", *generate_args], standalone_mode=False)
    summary = json.loads(stdout.getvalue().strip().splitlines()[-1])
    result.write_text(json.dumps({"summary": summary, "wall_s": time.monotonic() - wall,
                                  "driver_cpu_s": time.process_time() - cpu, **timings}))


def report(args, runs: dict[str, list[dict]], same: bool, driver: dict | None, config) -> None:
    rows = []
    for name, name_runs in runs.items():
        rates = [run["summary"]["output_tokens_per_s"] for run in name_runs]
        loops = [run["loop_wall_s"] for run in name_runs]
        rows.append({"config": name, "output_tok_s": rates, "median_output_tok_s": statistics.median(rates),
                     "generation_s": loops, "job_wall_s": [run["wall_s"] for run in name_runs]})
    one, two = (row["median_output_tok_s"] for row in rows)
    print(f"\n{'configuration':<24} {'output tok/s (median)':>22} {'runs':>28} {'job wall s':>16}")
    for row in rows:
        runs_text = ", ".join(f"{r:.1f}" for r in row["output_tok_s"])
        wall_text = ", ".join(f"{w:.1f}" for w in row["job_wall_s"])
        print(f"{row['config']:<24} {row['median_output_tok_s']:>22.1f} {runs_text:>28} {wall_text:>16}")
    print(f"2 replicas / 1 engine: {two / one:.2f}x; greedy records identical: {'yes' if same else 'NO'}")
    result = {"model": config.model, "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
              "output_len": args.output_len, "seed": args.seed}, "rounds": args.rounds, "configs": rows,
              "ratio_2x1_over_1x2": two / one, "records_identical": same, "cpu_count": os.cpu_count()}
    if driver is not None:
        records = driver["summary"]["requests"]
        per_1000 = 1000 * driver["loop_cpu_s"] / records
        print(f"driver: {driver['loop_cpu_s']:.2f} s CPU in its loop for {records} records = {per_1000:.3f} s per "
              f"1,000 records ({driver['loop_wall_s']:.1f} s wall; whole process {driver['driver_cpu_s']:.2f} s CPU "
              "with Ray's start)")
        result["driver"] = {"records": records, "loop_cpu_s": driver["loop_cpu_s"],
                            "loop_wall_s": driver["loop_wall_s"], "process_cpu_s": driver["driver_cpu_s"],
                            "cpu_s_per_1000_records": per_1000}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
