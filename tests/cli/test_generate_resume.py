"""Crash safety of `nanoinfer generate`: a real subprocess is killed (kill -9, SIGINT) and resumed.

At the end every line parses, no id appears twice, the ids are the input's, and greedy results equal those
of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from factories import count_lines, start_generate, wait_for
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_PROMPTS = 300
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paris", "capital", "cache", "block"]
runner = CliRunner()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny model, an input of NUM_PROMPTS greedy prompts, the engine flags, and an uninterrupted run."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("resume")
    model = build_tiny_model("qwen3", root / "model")
    rng = random.Random(0)
    source = root / "in.jsonl"
    with open(source, "w") as f:
        for i in range(NUM_PROMPTS):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            f.write(json.dumps({"id": f"p{i}", "prompt": prompt, "max_tokens": rng.randint(1, 8)}) + "\n")
    # max_num_seqs 4 keeps records coming out steadily, so the kills land mid-job.
    flags = [
        "--model",
        str(model),
        "--device",
        "cpu",
        "--max-model-len",
        "256",
        "--kvcache-block-size",
        "256",
        "--cpu-kvcache-space-gib",
        "0.02",
        "--max-num-seqs",
        "4",
        "--num-threads",
        "1",
        "--temperature",
        "0",
        "--quiet",
    ]
    reference = root / "reference.jsonl"
    result = runner.invoke(app, ["generate", str(source), "-o", str(reference), *flags])
    assert result.exit_code == 0, result.output
    yield {
        "root": root,
        "source": source,
        "flags": flags,
        "reference": results_by_id(read_records(reference)),
    }
    torch.set_num_threads(threads)


def read_records(path: Path, allow_torn_tail: bool = False) -> list[dict]:
    data = path.read_bytes() if path.exists() else b""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    assert allow_torn_tail or tail == b"", f"torn last line: {tail[:80]!r}"
    return [json.loads(line) for line in lines]  # every whole line parses



def results_by_id(records: list[dict]) -> dict:
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id appears twice"
    return {r["id"]: (r["text"], r["finish_reason"], r["usage"]["completion_tokens"]) for r in records}


def start(job, out: Path) -> subprocess.Popen:
    return start_generate(job["source"], out, "--resume", *job["flags"])


def assert_complete_and_equal_to_reference(job, out: Path) -> None:
    results = results_by_id(read_records(out))
    assert set(results) == {f"p{i}" for i in range(NUM_PROMPTS)}
    assert results == job["reference"]


def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_result(job, tmp_path):
    rng = random.Random(int(os.environ.get("NANOINFER_CRASH_SEED", "20240611")))
    out = tmp_path / "out.jsonl"
    manifest = tmp_path / "out.jsonl.manifest.json"
    kills = 0
    # First kill: as soon as the job has started its output (manifest written, records maybe not yet).
    proc = start(job, out)
    wait_for(proc, manifest.exists)
    time.sleep(rng.uniform(0, 0.05))
    proc.kill()
    proc.wait()
    kills += 1
    # Then kill -9 at a random moment after a random number of new records, in the first half of the job:
    # on a fast machine the records come in bursts, and a late kill could land after the last one.
    while kills < 5:
        target = min(count_lines(out) + rng.randint(1, 30), NUM_PROMPTS // 2)
        proc = start(job, out)
        wait_for(proc, lambda target=target: count_lines(out) >= target)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is not None:
            break  # it finished first
        proc.kill()
        assert proc.wait() == -signal.SIGKILL
        kills += 1
        read_records(out, allow_torn_tail=True)
    assert kills == 5, f"only {kills} kills landed before the job finished"
    assert count_lines(out) < NUM_PROMPTS
    result = runner.invoke(app, ["generate", str(job["source"]), "-o", str(out), "--resume", *job["flags"]])
    assert result.exit_code == 0, result.output
    assert_complete_and_equal_to_reference(job, out)


def test_sigint_flushes_finished_records_exits_130_and_resume_completes(job, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = start(job, out)
    wait_for(proc, lambda: count_lines(out) >= 20)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    message = stderr.decode()
    assert proc.returncode == 130, message
    assert "Run the same command with --resume" in message
    assert "Traceback" not in message
    written = read_records(out)  # a clean stop leaves no torn line
    assert 20 <= len(written) < NUM_PROMPTS
    assert set(results_by_id(written).items()) <= set(job["reference"].items())
    result = runner.invoke(app, ["generate", str(job["source"]), "-o", str(out), "--resume", *job["flags"]])
    assert result.exit_code == 0, result.output
    assert f"(+{len(written)} from an earlier run)" in result.output
    assert_complete_and_equal_to_reference(job, out)
