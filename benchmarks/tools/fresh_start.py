"""A fresh machine's first run of the README's main command: empty caches (the default model, the CPU kernels'
build), timed to the first record written and to the end of the command.

    python benchmarks/tools/fresh_start.py [--src DIR] [--rounds N] [--output-json FILE]

--src runs another checkout's sources (PYTHONPATH) in the same environment, so two revisions can be set side by
side in one run, alternated. pip install is not counted; the default model's wheel comes from pip's cache or
the package index, as on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(src: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="nanoinfer-fresh-"))
    out = cache / "out.jsonl"
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"),
               PYTHONPATH=str(src))  # fmt: skip
    env.pop("NANOINFER_CACHE_DIR", None)
    command = [sys.executable, "-m", "nanoinfer", "generate", str(ROOT / "data" / "prompts.jsonl"), "-o", str(out),
               "--overwrite"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_record = None
    while proc.poll() is None:
        if first_record is None and out.exists() and out.stat().st_size > 0:
            first_record = time.perf_counter() - start
        time.sleep(0.02)
    end = time.perf_counter() - start
    stderr = proc.stderr.read()
    if first_record is None and out.exists() and out.stat().st_size > 0:
        first_record = end
    records = len(out.read_text().splitlines()) if out.exists() else 0
    # A background build started by the run outlives it: wait for it before the next round's timing.
    while any((cache / "torch_extensions").rglob("nanoinfer-background-build")):
        time.sleep(1)
    shutil.rmtree(cache, ignore_errors=True)
    return {"exit_code": proc.returncode, "records": records, "first_record_s": first_record, "total_s": end,
            "stderr_tail": stderr.strip().splitlines()[-3:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", type=Path, help="a checkout's src/ (repeat to alternate)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    sources = args.src or [ROOT / "src"]
    results = {str(s): [] for s in sources}
    for _ in range(args.rounds):
        for src in sources:
            run = one_run(src)
            results[str(src)].append(run)
            print(f"{src}: exit {run['exit_code']}, {run['records']} records, first record "
                  f"{run['first_record_s']:.1f} s, total {run['total_s']:.1f} s", flush=True)  # fmt: skip
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
