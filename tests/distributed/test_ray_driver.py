"""The Ray driver loop with a fake Ray (no cluster): a replica that Ray restarts while it is idle between two
work() calls loses its lines without any call failing; the driver must see the new incarnation, retry the
lines on the others and reset the replica, so every line is written once and the job ends."""

from __future__ import annotations

import types
import uuid

import pytest

pytest.importorskip("ray")

from nanoinfer.jobs import ray_replicas  # noqa: E402
from nanoinfer.jobs.line_runner import FinishedLine  # noqa: E402
from nanoinfer.jsonl.lines import NATIVE  # noqa: E402
from nanoinfer.jsonl.requests import BatchRequest  # noqa: E402
from nanoinfer.sampling_params import SamplingParams  # noqa: E402


class _Call:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Call(self.fn, args)


class FakeActor:
    """Finishes one line per work() call; with `restart_after`, Ray "restarts" it after that many calls."""

    def __init__(self, restart_after: int | None = None):
        self.incarnation, self.pending, self.num_calls, self.restart_after = uuid.uuid4().hex, {}, 0, restart_after
        self.work = _Method(self._work)
        self.ready = _Method(lambda: {"incarnation": self.incarnation, "node": "n", "pid": 0, "error": None})

    def _work(self, requests):
        self.num_calls += 1
        self.pending.update((r.line, r) for r in requests)
        done = []
        if self.pending:
            line = min(self.pending)
            del self.pending[line]
            done.append(FinishedLine(line, {"line": line}, {}, False))
        if self.num_calls == self.restart_after:  # killed while idle, after answering; Ray builds a new one
            self.restart()
        return done, dict.fromkeys(ray_replicas._STATS, 0), self.incarnation

    def restart(self):
        self.incarnation, self.pending = uuid.uuid4().hex, {}


class _Pool:
    num_replicas, start_timeout = 2, 900.0

    def __init__(self, actors):
        self.notes = []
        self.slots = [ray_replicas._Slot(i, actor, 0.0, actor.incarnation) for i, actor in enumerate(actors)]

    def notify(self, text):
        self.notes.append(text)

    @property
    def live_slots(self):
        return [s for s in self.slots if not s.is_dead]


class _Writer:
    def __init__(self):
        self.lines = []

    def write(self, record):
        self.lines.append(record["line"])

    def sync_if_due(self):
        pass


class _Progress:
    def __init__(self):
        self.failures = 0

    def on_step(self, *args):
        pass

    def on_record(self, *args):
        pass

    def on_replica_failure(self, num_retried):
        self.failures += 1


class _Stopper:
    def __init__(self, limit: int):
        self.checks, self.limit = 0, limit

    @property
    def stopping(self) -> bool:
        self.checks += 1
        return self.checks > self.limit  # a spinning driver is stopped here instead of hanging the test


def test_a_replica_restarted_while_idle_has_its_lines_retried_and_every_line_is_written_once(monkeypatch):
    fake_ray = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]),
                                     get=lambda call: call.fn(*call.args),
                                     kill=lambda actor, no_restart=False: actor.restart())
    monkeypatch.setattr(ray_replicas, "ray", fake_ray)
    pool = _Pool([FakeActor(restart_after=1), FakeActor()])
    writer, progress, stopper = _Writer(), _Progress(), _Stopper(limit=20_000)
    requests = [BatchRequest(i, f"id{i}", NATIVE, SamplingParams(max_tokens=4), prompt="p")
                for i in range(1, 7)]
    driver = ray_replicas._Driver(pool, requests, writer, progress, 4, stopper)
    driver.run()
    assert stopper.checks <= stopper.limit, "the driver spun on a replica that had lost its lines"
    assert sorted(writer.lines) == [1, 2, 3, 4, 5, 6]  # every line once: none lost, none twice
    assert progress.failures == 1 and "restarted between two calls" in pool.notes[0]
