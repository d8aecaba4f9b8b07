"""Output failures end a `generate` job cleanly: a full disk (a real, small tmpfs), a full device, a closed
pipe. Each exits with its documented code and one message, leaves no torn record, and (for a file) --resume
then finishes the job with every id exactly once and the records of an uninterrupted run."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoinfer.cli.generate import EXIT_CLOSED_PIPE, EXIT_OUTPUT_FAILED
from nanoinfer.errors import OutputWriteError
from nanoinfer.jsonl.manifest import manifest_path, read_manifest
from nanoinfer.jsonl.writer import RecordWriter
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_PROMPTS = 120


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny model, an input file, the engine flags and the records of an uninterrupted run."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("outfail")
    model = build_tiny_model("qwen3", root / "model")
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count {i} and {i + 1}"}) + "\n"
                              for i in range(NUM_PROMPTS)))
    flags = ["--model", str(model), "--device", "cpu", "--max-model-len", "64", "--kvcache-block-size", "256",
             "--cpu-kvcache-space-gib", "0.02", "--max-num-seqs", "4", "--temperature", "0", "--max-tokens", "4",
             "--quiet"]
    clean = root / "clean.jsonl"
    done = run(source, clean, flags)
    assert done.returncode == 0, done.stderr
    yield source, flags, {r["id"]: r for r in read_records(clean)}
    torch.set_num_threads(threads)


def run(source, output, flags, *extra, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nanoinfer", "generate", str(source), "-o", str(output), *flags, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


def read_records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a torn last record"
    return [json.loads(line) for line in data.splitlines()]


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "line"}


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_stops_the_job_cleanly_and_resume_finishes_it(job, tmp_path):
    source, flags, clean = job
    with small_tmpfs(tmp_path / "disk", "12k") as disk:
        output = disk / "out.jsonl"
        failed = run(source, output, flags)
        assert failed.returncode == EXIT_OUTPUT_FAILED, failed.stderr
        assert "Traceback" not in failed.stderr
        assert "No space left on device" in failed.stderr
        assert "run the same command with --resume" in failed.stderr
        partial = read_records(output)  # every record whole: the torn one was cut off
        assert 0 < len(partial) < NUM_PROMPTS
        assert f"{len(partial)} of {NUM_PROMPTS} records are safely in" in failed.stderr
        assert read_manifest(manifest_path(output))["input"]["num_lines"] == NUM_PROMPTS

        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        resumed = run(source, output, flags, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        records = read_records(output)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(clean) and len(set(ids)) == len(ids)  # every id exactly once
    assert all(comparable(r) == comparable(clean[r["id"]]) for r in records)


def test_a_full_device_on_stdout_exits_74_with_one_message(job):
    source, flags, _ = job
    with open("/dev/full", "wb") as full:
        cmd = [sys.executable, "-m", "nanoinfer", "generate", str(source), "-o", "-", *flags]
        failed = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert failed.returncode == EXIT_OUTPUT_FAILED
    assert "No space left on device" in failed.stderr and "rerun with -o FILE" in failed.stderr
    assert "Traceback" not in failed.stderr and "Exception ignored" not in failed.stderr


def test_a_closed_pipe_ends_the_job_quietly(job, tmp_path):
    """`nanoinfer generate in.jsonl -o - | head -1`: the first record arrives whole, then a quiet exit 141."""
    source, flags, clean = job
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"id": f"b{i}", "prompt": "count"}) + "\n" for i in range(3000)))
    cmd = [sys.executable, "-m", "nanoinfer", "generate", str(big), "-o", "-", *flags, "--max-tokens", "1"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = json.loads(process.stdout.readline())
    process.stdout.close()  # what head does after its first line
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == EXIT_CLOSED_PIPE
    assert first["id"] == "b0" and first["error"] is None
    assert stderr.strip() == "", stderr  # no traceback, no "Exception ignored", no message


def test_a_write_cut_short_is_cut_back_to_the_last_whole_record(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    writer = RecordWriter(path)
    writer.write({"id": "a", "line": 1})
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OutputWriteError, match="No space left on device") as failure:
        writer.write({"id": "b", "line": 2})
    assert failure.value.errno == errno.ENOSPC and not failure.value.closed_pipe
    assert path.read_bytes() == b'{"id":"a","line":1}\n'  # the half record is gone
    with pytest.raises(OutputWriteError):  # a failed writer takes nothing more
        writer.write({"id": "c", "line": 3})
    writer.close()
