"""`nanoinfer generate --data-parallel-size N` on a real local Ray instance (2 CPUs, one torch thread per
replica, the tiny model): the records are the single-engine ones, bad lines included; a killed replica's lines
are retried on the others; a line that keeps killing replicas gets an error record; a driver killed with -9 is
resumed with another number of replicas; nothing is lost or written twice.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from factories import count_lines, start_generate, wait_for
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.jsonl.reader import BatchReader
from nanoinfer.jsonl.records import record_line_number
from nanoinfer.jsonl.writer import RecordWriter
from nanoinfer.testing.tiny_models import build_tiny_model

ray = pytest.importorskip("ray")
from nanoinfer.jobs import ray_replicas  # noqa: E402  (needs Ray)

runner = CliRunner()
NUM_PROMPTS = 240
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paris", "capital", "cache", "block"]
# max_num_seqs 4 keeps records coming out steadily, so that kills land mid-job.
FLAGS = ["--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "256", "--cpu-kvcache-space-gib",
         "0.02", "--max-num-seqs", "4", "--num-threads", "1", "--temperature", "0", "--quiet"]


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module: 2 CPUs, as on the CI machine."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    for signum, handler in handlers.items():  # ray.init takes SIGTERM; the CLI tests need the default back
        signal.signal(signum, handler)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def input_lines(rng: random.Random) -> list[dict | str]:
    lines: list[dict | str] = []
    for i in range(NUM_PROMPTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
        lines.append({"id": f"p{i}", "prompt": prompt, "max_tokens": rng.randint(4, 16)})
    bad = [
        "this is not json",
        {"id": "p3", "prompt": "an id already used"},
        {"id": "unknown", "prompt": "x", "temprature": 0},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt_token_ids": [7] * 300},  # longer than max_model_len: refused by the replica
        {"id": "oov", "prompt_token_ids": [1, 10**6]},  # outside the vocabulary: refused by the replica
        {"id": "chat", "messages": [{"role": "user", "content": "the capital of paris"}], "max_tokens": 5},
        {"id": "n2", "prompt": "the lazy dog", "n": 2, "max_tokens": 4},
        {"custom_id": "openai", "method": "POST", "url": "/v1/completions", "body": {"prompt": "fox", "max_tokens": 3}},
        {"custom_id": "openai-bad", "method": "POST", "url": "/v1/nope", "body": {}},
    ]
    for item in bad:
        lines.insert(rng.randrange(len(lines)), item)
    return lines


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny model, the input, and the records of one engine in this process (the reference)."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("ray-replicas")
    model = build_tiny_model("qwen3", root / "model")
    source = root / "in.jsonl"
    lines = input_lines(random.Random(0))
    source.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    flags = ["--model", str(model), *FLAGS]
    reference = root / "reference.jsonl"
    result = runner.invoke(app, ["generate", str(source), "-o", str(reference), *flags])
    assert result.exit_code == 0, result.output
    records = read_records(reference)
    assert sum(r["error"] is not None for r in records) == 7  # the bad lines above that are errors
    yield {"root": root, "source": source, "flags": flags, "num_lines": len(records), "reference": by_line(records)}
    torch.set_num_threads(threads)


def read_records(path: Path, allow_torn_tail: bool = False) -> list[dict]:
    data = path.read_bytes() if path.exists() else b""
    lines = data.split(b"\n")
    tail = lines.pop()
    assert allow_torn_tail or tail == b"", f"torn last line: {tail[:80]!r}"
    return [json.loads(line) for line in lines]


def by_line(records: list[dict]) -> dict[int, dict]:
    """Records keyed by input line, each line once; OpenAI records lose their `created` time."""
    keyed = {}
    for record in records:
        line = record_line_number(record)
        assert line not in keyed, f"line {line} has two records"
        body = (record.get("response") or {}).get("body") or {}
        body.pop("created", None)
        keyed[line] = record
    return keyed




def generate(job, out: Path, *args: str):
    return runner.invoke(app, ["generate", str(job["source"]), "-o", str(out), *job["flags"], *args])


def assert_same_records(job, out: Path) -> None:
    assert by_line(read_records(out)) == job["reference"]


def summary(result) -> dict:
    """The --json summary: the one line of stdout that is a JSON object."""
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(line)


class ReplicaKiller(threading.Thread):
    """Waits for the job's replicas to start, then SIGKILLs `which` of them once OUTPUT has `after` records."""

    def __init__(self, out: Path, after: int, which: tuple[int, ...] = (0,)):
        super().__init__(daemon=True)
        self.out, self.after, self.which = out, after, which
        self.before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        self.killed: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            actors = self._wait_for_replicas()
            pids = [ray.get(actor.ready.remote(), timeout=60)["pid"] for actor in actors]
            deadline = time.monotonic() + 120
            while count_lines(self.out) < self.after:
                assert time.monotonic() < deadline, "the job made no progress"
                time.sleep(0.002)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
        except BaseException as e:  # reported by the test
            self.error = e

    def _wait_for_replicas(self) -> list:
        deadline = time.monotonic() + 120
        while True:
            new = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"] not in self.before and "-replica-" in a["name"]}
            wanted = [name for name in new if int(name.rsplit("-", 1)[1]) in self.which]
            if len(wanted) == len(self.which):
                return [ray.get_actor(name, namespace=new[name]) for name in sorted(wanted)]
            assert time.monotonic() < deadline, "the replicas did not start"
            time.sleep(0.05)


# ---- the same job, wider ---------------------------------------------------------------------------------------
def test_two_replicas_write_the_records_one_engine_writes(job, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    result = generate(job, out, "--data-parallel-size", "2", "--json")
    assert result.exit_code == 0, result.output
    assert_same_records(job, out)  # every line once; error records and greedy records identical
    s = summary(result)
    assert (s["requests"], s["errors"], s["replica_failures"], s["retries"]) == (job["num_lines"], 7, 0, 0)
    assert "Traceback" not in result.output


def test_a_replica_killed_mid_job_has_its_lines_retried_on_the_other(job, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    killer = ReplicaKiller(out, after=40)
    killer.start()
    result = generate(job, out, "--data-parallel-size", "2", "--json")
    killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert result.exit_code == 0, result.output
    assert count_lines(out) > 40 and len(killer.killed) == 1
    s = summary(result)
    assert s["replica_failures"] == 1 and s["retries"] >= 1, s  # it had lines in flight, and they were redone
    assert "replica 0 (node" in result.output and "unfinished lines go to the other replicas" in result.output
    assert "lines retried" in result.output  # the summary line says so too
    assert_same_records(job, out)


def test_driver_killed_with_sigkill_resumes_with_another_number_of_replicas(job, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    proc = start_generate(job["source"], out, *job["flags"], "--data-parallel-size", "2", "--ray-address", ray_address)
    wait_for(proc, lambda: count_lines(out) >= 60, poll=0.002)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
    proc.stderr.close()
    written = read_records(out, allow_torn_tail=True)
    assert 60 <= len(written) < job["num_lines"]
    # The cluster ends the dead driver's replicas by itself.
    deadline = time.monotonic() + 60
    while {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} - before:
        assert time.monotonic() < deadline, "the killed driver's replicas are still running"
        time.sleep(0.1)
    result = generate(job, out, "--resume")  # one engine, no Ray
    assert result.exit_code == 0, result.output
    assert "records already written" in result.output
    assert_same_records(job, out)


def test_every_replica_dead_ends_the_job_and_resume_finishes_it(job, ray_address, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_replicas, "MAX_RESTARTS", 0)
    out = tmp_path / "out.jsonl"
    killer = ReplicaKiller(out, after=30, which=(0, 1))
    killer.start()
    result = generate(job, out, "--data-parallel-size", "2")
    killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert result.exit_code == 1, result.output
    assert "every replica has died" in result.output and "--resume" in result.output
    assert "Traceback" not in result.output
    assert 30 <= len(read_records(out)) < job["num_lines"]
    result = generate(job, out, "--resume", "--data-parallel-size", "2")
    assert result.exit_code == 0, result.output
    assert_same_records(job, out)


# ---- a line that kills every replica it runs on -----------------------------------------------------------------
class PoisonReplica(ray_replicas.Replica):
    """Dies (as if a kernel crashed) whenever it is handed a line whose prompt says POISON."""

    def work(self, requests):
        if any("POISON" in (r.prompt or "") for r in requests):
            os._exit(1)
        return super().work(requests)


def test_a_line_that_keeps_killing_replicas_gets_an_error_record_and_the_job_goes_on(job, ray_address, tmp_path):
    from nanoinfer.cli.generate import Stopper
    from nanoinfer.config import Config
    from nanoinfer.progress import JobProgress

    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import this test module
    prompts = [{"id": f"q{i}", "prompt": "the quick brown fox", "max_tokens": 4} for i in range(24)]
    prompts[9] = {"id": "poison", "prompt": "POISON the lazy dog", "max_tokens": 4}
    lines = [json.dumps(p).encode() + b"\n" for p in prompts]
    config = Config(model=job["flags"][1], device="cpu", max_model_len=256, cpu_kvcache_space_gib=0.02,
                    max_num_seqs=4, num_threads=1)
    notes: list[str] = []
    pool = ray_replicas.ReplicaPool(config, 2, notify=notes.append, replica_cls=PoisonReplica)
    out = tmp_path / "out.jsonl"
    writer = RecordWriter(out)
    progress = JobProgress(len(lines), plain=True, log_seconds=1e9)
    try:
        reader = BatchReader(lines, {"temperature": 0, "max_tokens": 4})
        ray_replicas.stream_requests(pool, reader, writer, progress, 4, Stopper())
    finally:
        writer.close()
        pool.close()
        ray.cloudpickle.unregister_pickle_by_value(module)
    records = {r["id"]: r for r in read_records(out)}
    assert sorted(records) == sorted(p["id"] for p in prompts)  # every line once
    assert records["poison"]["error"]["code"] == "replica_failed"
    assert [r["id"] for r in records.values() if r["error"]] == ["poison"]  # nothing else was blamed
    # It died with up to 4 lines in flight, then with them alone, then in halves down to itself: 2 + log2(4).
    assert 2 <= progress.num_replica_failures <= 4, notes
    assert progress.summary()["retries"] == progress.num_retries >= 1


# ---- refused before anything starts ------------------------------------------------------------------------------
def test_without_ray_more_replicas_exit_2_saying_how_to_install_it(job, tmp_path, monkeypatch):
    import nanoinfer.jobs

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    monkeypatch.delitem(sys.modules, "nanoinfer.jobs.ray_replicas")
    monkeypatch.delattr(nanoinfer.jobs, "ray_replicas")
    out = tmp_path / "out.jsonl"
    result = generate(job, out, "--data-parallel-size", "2")
    assert result.exit_code == 2, result.output
    assert "pip install 'nanoinfer[ray]'" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_more_replicas_than_the_local_instance_holds_are_refused(job, ray_address):
    from nanoinfer.config import Config
    from nanoinfer.errors import ReplicaError

    config = Config(model=job["flags"][1], device="cpu")
    options, description, shortfall = ray_replicas._replica_options(config, 2, local=True)
    assert (options["num_cpus"], options["num_threads"], description) == (1, 1, "2 replicas x 1 CPU thread(s)")
    assert shortfall is None
    # A joined cluster may grow (an autoscaler, nodes still joining): the replicas that do not fit wait.
    _, _, shortfall = ray_replicas._replica_options(config, 3, local=False)
    assert shortfall == "the cluster has 2 CPUs now: some replicas wait until it has room (or more nodes)"
    with pytest.raises(ReplicaError, match=r"needs 3 x 1 CPUs, but this machine's Ray instance has 2"):
        ray_replicas._replica_options(config, 3, local=True)
    config.num_threads = 2
    with pytest.raises(ReplicaError, match=r"needs 2 x 2 CPUs"):
        ray_replicas._replica_options(config, 2, local=True)


def test_a_replica_that_cannot_load_the_model_is_reported_before_the_job_starts(job, ray_address, tmp_path):
    import shutil

    from nanoinfer.config import Config
    from nanoinfer.errors import ReplicaError

    model = Path(shutil.copytree(job["flags"][1], tmp_path / "model"))
    config = Config(model=str(model), device="cpu", max_model_len=256, cpu_kvcache_space_gib=0.02, num_threads=1)
    shutil.rmtree(model)  # as on a node where the model folder is missing
    with pytest.raises(ReplicaError, match=r"(?s)replica \d \(node .*\) failed to start: .*model = .*does not exist"):
        ray_replicas.ReplicaPool(config, 2)
    deadline = time.monotonic() + 30
    while any("-replica-" in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "the replicas of a pool that failed to start are still running"
        time.sleep(0.1)


def test_a_ray_address_where_nothing_answers_exits_2_at_once(job, tmp_path):
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "nanoinfer", "generate", str(job["source"]), "-o", str(out), *job["flags"],
               "--data-parallel-size", "2", "--ray-address", "127.0.0.1:1"]  # a fresh process: not on Ray yet
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "could not connect to the Ray cluster at '127.0.0.1:1': nothing answers" in result.stderr
    assert "ray start --head" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_data_parallel_flags_are_checked_before_anything_loads(job, tmp_path):
    out = tmp_path / "out.jsonl"
    result = generate(job, out, "--data-parallel-size", "0")
    assert result.exit_code == 2 and "--data-parallel-size must be >= 1" in result.output
    assert not out.exists()
