"""`generate --data-parallel-size N`: N engine replicas as Ray actors, fed from one input into one output.

This process (the driver) parses the input with the job's BatchReader (ids, duplicates and parse errors are
decided here, as on one engine), hands lines out with the Dispatcher and writes every record with the job's
one RecordWriter, so records, --resume and output failures are the single-engine ones. A Replica owns an
LLM and a LineRunner and returns finished records in small batches. Imported only when a job asks for
replicas: Ray is an optional extra.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError

from nanoinfer.errors import NanoInferError, ReplicaError
from nanoinfer.jobs.dispatch import Dispatcher
from nanoinfer.jobs.line_runner import FinishedLine, LineRunner, error_line
from nanoinfer.jsonl.lines import LineError
from nanoinfer.jsonl.reader import BatchReader
from nanoinfer.jsonl.requests import BatchRequest
from nanoinfer.jsonl.writer import RecordWriter

logger = logging.getLogger("nanoinfer")

# A work() call returns once it has records and has run this long, or after the longer time in any case:
# long enough that the round trip to the driver is a few percent of a call, short enough for a live bar.
WORK_MIN_SECONDS = 0.05
WORK_MAX_SECONDS = 0.5
# Ray restarts a dead replica this often before it is dropped. One poison line costs 2 + log2(in flight) deaths
# (13 at the default max_in_flight of 2,048), so this covers about five of them on one replica.
MAX_RESTARTS = 64
START_TIMEOUT_SECONDS = 900.0  # a replica not ready by then (no room on the cluster, a hung load) is dropped
_STATS = ("num_prefill_tokens", "num_decode_tokens", "num_preempted", "num_draft_tokens", "num_accepted_tokens")


class Replica:
    """One engine replica, run as a Ray actor: an LLM built from the job's settings, serving BatchRequests."""

    def __init__(self, settings: dict):
        from nanoinfer.config import Config
        from nanoinfer.llm import LLM

        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new incarnation with an empty engine
        self.error: str | None = None
        try:
            self.runner = LineRunner(LLM(config=Config(**settings)))
        except NanoInferError as e:  # the user's to fix (e.g. the model folder is missing on this node)
            self.error = str(e)

    def ready(self) -> dict:
        return {"incarnation": self.incarnation, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "error": self.error}

    def work(self, requests: list[BatchRequest]) -> tuple[list[FinishedLine], dict[str, int], str]:
        """Admit `requests`, then step until lines have finished (or for WORK_MAX_SECONDS): (finished, stats,
        incarnation). The incarnation tells the driver when Ray restarted the actor between two calls."""
        finished = [done for request in requests if (done := self.runner.add(request)) is not None]
        totals = dict.fromkeys(_STATS, 0)
        start = time.monotonic()
        while self.runner.pending:
            done, stats = self.runner.step()
            finished += done
            for name in _STATS:
                totals[name] += getattr(stats, name)
            elapsed = time.monotonic() - start
            if (finished and elapsed >= WORK_MIN_SECONDS) or elapsed >= WORK_MAX_SECONDS:
                break
        return finished, totals, self.incarnation


@dataclass
class _Slot:
    """One replica as the driver sees it."""

    index: int
    actor: object
    started: float  # when its current (re)start began
    incarnation: str | None = None  # of the live actor; None while it (re)starts
    previous: str | None = None  # the incarnation that failed: if ready() reports it again, it must be reset
    node: str = "?"
    is_dead: bool = False


class ReplicaPool:
    """Connects to Ray (or starts a local instance), starts `num_replicas` Replica actors and waits until
    each has loaded the model. close() stops them (and the local instance).

    Args:
        config: the job's Config; each replica builds its own from its fields.
        num_replicas: --data-parallel-size.
        address: None starts a local Ray instance for the job; "auto" or "HOST:PORT" joins a running cluster.
            A process already connected to Ray (ray.init called before) uses that connection.
        notify: prints one line for the user (replica failures).
        replica_cls: the actor's class (tests pass one that fails on purpose).

    Raises:
        ReplicaError: the cluster cannot be reached or cannot hold the replicas, or a replica failed to start.
    """

    def __init__(self, config, num_replicas: int, address: str | None = None, *, notify=logger.warning,
                 replica_cls=Replica, start_timeout: float = START_TIMEOUT_SECONDS):
        self.config = config
        self.num_replicas = num_replicas
        self.notify = notify
        self.start_timeout = start_timeout
        self.slots: list[_Slot] = []
        self._placement_groups = []
        self._owns_connection = _connect(address)
        try:
            self.options, self.description, shortfall = _replica_options(config, num_replicas, address is None)
            if shortfall:
                notify(f"--data-parallel-size {num_replicas}: {shortfall}")
            settings = {**config.to_dict(), "num_threads": self.options.pop("num_threads")}
            remote_cls = ray.remote(replica_cls)
            job = uuid.uuid4().hex[:8]
            for index in range(num_replicas):
                options = dict(self.options, name=f"nanoinfer-{job}-replica-{index}")
                if config.device == "cuda":
                    options["scheduling_strategy"] = self._placement_group(options["num_gpus"])
                actor = remote_cls.options(**options).remote(settings)
                self.slots.append(_Slot(index, actor, started=time.monotonic()))
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    def _placement_group(self, num_gpus: int):
        # One bundle per replica: its tensor-parallel ranks share a node (NCCL within a node).
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([{"CPU": 1, "GPU": num_gpus}], strategy="STRICT_PACK")
        self._placement_groups.append(group)
        return PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)

    def _wait_until_ready(self) -> None:
        calls = {slot.actor.ready.remote(): slot for slot in self.slots}
        deadline = time.monotonic() + self.start_timeout
        while calls:
            done, _ = ray.wait(list(calls), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                raise ReplicaError(
                    f"{len(calls)} of {self.num_replicas} replicas did not start within {self.start_timeout:.0f} s: "
                    f"the cluster has no room for them ({self.description}). Check `ray status`, free or "
                    "add resources, or lower --data-parallel-size."
                )
            slot = calls.pop(done[0])
            try:
                info = ray.get(done[0])
            except RayError as e:
                raise ReplicaError(f"replica {slot.index} failed to start: {_reason(e)}") from None
            if info["error"]:
                raise ReplicaError(f"replica {slot.index} (node {info['node']}) failed to start: {info['error']}")
            slot.incarnation, slot.node = info["incarnation"], info["node"]

    @property
    def live_slots(self) -> list[_Slot]:
        return [slot for slot in self.slots if not slot.is_dead]

    def close(self) -> None:
        for slot in self.slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for group in self._placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.slots, self._placement_groups = [], []
        if self._owns_connection:
            self._owns_connection = False
            ray.shutdown()


def _connect(address: str | None) -> bool:
    """Connect this process to Ray; True when it did (and so must disconnect), False when it already was."""
    if ray.is_initialized():
        return False
    # ray.init installs its own SIGTERM handler; the job's Stopper must keep SIGINT and SIGTERM.
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address is None:
            ray.init(num_cpus=_usable_cpus(), **quiet)
        else:
            _check_reachable(address)
            ray.init(address=address, **quiet)
    except Exception as e:  # Ray's own errors for an unreachable, refusing or broken cluster vary by version
        where = "a local Ray instance" if address is None else f"the Ray cluster at {address!r}"
        fix = (
            "Start one with `ray start --head` (and `ray start --address HEAD:6379` on the other nodes), or leave "
            "out --ray-address to run a local instance." if address is not None else "Check /tmp/ray for its logs."
        )
        raise ReplicaError(f"could not connect to {where}: {_first_line(str(e))}. {fix}") from None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    # The raylet's own messages ("A worker died ...") go to the driver's stdout, where records may be; the
    # job reports replica failures itself. Ray's debugger silences them with the same switch.
    ray._private.worker._worker_logs_enabled = False
    return True


def _check_reachable(address: str) -> None:
    """HOST:PORT must accept a connection: ray.init retries an unreachable address for many minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray reads itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {host}:{port} ({e.strerror or e})") from None


def _usable_cpus() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _replica_options(config, num_replicas: int, local: bool) -> tuple[dict, str, str | None]:
    """Ray actor options for one replica (plus its num_threads), the job's shape in words, and why some
    replicas must wait for room on a joined cluster (None if they fit).

    CPU: each replica takes num_threads CPUs (default: the machine's or cluster's cores split evenly).
    CUDA: each replica takes tensor_parallel_size GPUs on one node.
    """
    resources = ray.cluster_resources()
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    options = {"max_restarts": MAX_RESTARTS, "max_task_retries": 0}
    if config.device == "cuda":
        kind, per_replica = "GPU", config.tensor_parallel_size
        options |= {"num_cpus": 1, "num_gpus": per_replica, "num_threads": config.num_threads}
        description = f"{num_replicas} replicas x {per_replica} GPU(s)"
        fix = "Lower --data-parallel-size or --tensor-parallel-size, or add GPU nodes."
    else:
        kind = "CPU"
        largest = int(max((node.get("CPU", 0) for node in nodes), default=0))
        per_replica = config.num_threads or max(1, min(int(resources.get("CPU", 0)) // num_replicas, largest))
        options |= {"num_cpus": per_replica, "num_threads": per_replica}
        description = f"{num_replicas} replicas x {per_replica} CPU thread(s)"
        fix = "Lower --data-parallel-size or --num-threads, or add nodes."
    total = int(resources.get(kind, 0))
    largest = int(max((node.get(kind, 0) for node in nodes), default=0))
    if num_replicas * per_replica > total or per_replica > largest:
        if local:
            raise ReplicaError(
                f"--data-parallel-size {num_replicas} needs {num_replicas} x {per_replica} {kind}s, but this "
                f"machine's Ray instance has {total}. {fix}"
            )
        shortfall = f"the cluster has {total} {kind}s now: some replicas wait until it has room (or more nodes)"
        return options, f"{description} ({shortfall})", shortfall
    return options, description, None


def stream_requests(pool: ReplicaPool, reader: BatchReader, writer: RecordWriter, progress,
                    max_in_flight: int, stopper) -> None:
    """The single-engine loop's twin: keep every replica busy with up to max_in_flight lines, write each record
    as it comes back. Raises ReplicaError when no replica is left."""
    _Driver(pool, reader, writer, progress, max_in_flight, stopper).run()


class _Driver:
    def __init__(self, pool: ReplicaPool, reader, writer, progress, max_in_flight: int, stopper):
        self.pool, self.writer, self.progress, self.stopper = pool, writer, progress, stopper
        self.dispatcher = Dispatcher(iter(reader), max_in_flight)
        self.calls: dict = {}  # ObjectRef -> (slot, "work" | "ready")
        for slot in pool.live_slots:
            self.dispatcher.add_replica(slot.index)

    def run(self) -> None:
        while not self.stopper.stopping:
            busy = {slot.index for slot, _ in self.calls.values()}
            for slot in self.pool.live_slots:
                if slot.index not in busy and slot.incarnation is not None:
                    self._feed(slot)
            if not self.calls:
                if self.dispatcher.is_done:
                    return
                raise ReplicaError(
                    f"every replica has died ({self.pool.num_replicas} started; the failures are listed above), "
                    "so the job cannot go on."
                )
            done, _ = ray.wait(list(self.calls), num_returns=1, timeout=1.0)
            for ref in done:
                slot, kind = self.calls.pop(ref)
                (self._on_work if kind == "work" else self._on_ready)(slot, ref)
            self._drop_stuck_starts()
            self.writer.sync_if_due()

    def _feed(self, slot: _Slot) -> None:
        while not self.stopper.stopping:
            requests, errors = self.dispatcher.next_work(slot.index)
            for error in errors:
                self._write(error_line(error))
            if requests or not errors:
                break
        else:
            return
        if requests or self.dispatcher.num_in_flight(slot.index):
            self.calls[slot.actor.work.remote(requests)] = (slot, "work")

    def _on_work(self, slot: _Slot, ref) -> None:
        try:
            finished, stats, incarnation = ray.get(ref)
        except RayError as e:  # the actor died (killed, OOM, node lost) or its engine raised
            self._failed(slot, _reason(e))
            return
        self.progress.on_step(*(stats[name] for name in _STATS))
        for line in finished:
            if self.dispatcher.finished(slot.index, line.line) is not None:
                self._write(line)
        if incarnation != slot.incarnation:
            # Ray restarted it while it was idle between two calls: no call failed, but the lines of the old
            # engine are gone. The new one holds this call's lines, which go to others now: reset it too.
            self._failed(slot, "restarted between two calls (killed while idle)", reset=incarnation)

    def _failed(self, slot: _Slot, reason: str, reset: str | None = None) -> None:
        retried, given_up = self.dispatcher.fail(slot.index)
        self.progress.on_replica_failure(len(retried))
        for request in given_up:
            self._write(error_line(LineError(
                request.line, request.id, request.kind, "replica_failed",
                f"line {request.line}: every replica that ran this line died (the last one with only this line "
                "in flight), so it was given up; the job went on without it. Check the line (an input that "
                "exhausts memory?) and the replicas' logs (/tmp/ray/session_latest/logs on their nodes).",
            )))
        gave_up = f"; {len(given_up)} line given up" if given_up else ""
        self.pool.notify(f"replica {slot.index} (node {slot.node}) failed: {reason}; {len(retried)} unfinished "
                         f"lines go to the other replicas{gave_up}")
        self._restart(slot, reset)

    def _restart(self, slot: _Slot, reset: str | None = None) -> None:
        # Ray restarts a dead actor by itself (max_restarts); ready() answers once it is back. An incarnation
        # that must not be used as it is (`reset`, or the failed one answering again) is restarted in _on_ready.
        slot.previous = reset or slot.incarnation or slot.previous
        slot.incarnation, slot.started = None, time.monotonic()
        self.calls[slot.actor.ready.remote()] = (slot, "ready")

    def _on_ready(self, slot: _Slot, ref) -> None:
        try:
            info = ray.get(ref)
        except ActorDiedError as e:  # out of restarts, or it cannot be rebuilt
            self._drop(slot, _reason(e))
            return
        except RayActorError:  # not reachable yet: ask again
            self.calls[slot.actor.ready.remote()] = (slot, "ready")
            return
        if info["error"]:
            self._drop(slot, info["error"])
        elif info["incarnation"] == slot.previous:
            # It did not die (a lost connection, or its engine raised): it may still hold the lines that were
            # handed to others, so it restarts with an empty engine before it gets more.
            ray.kill(slot.actor, no_restart=False)
            self.calls[slot.actor.ready.remote()] = (slot, "ready")
        else:
            slot.incarnation, slot.node = info["incarnation"], info["node"]

    def _drop_stuck_starts(self) -> None:
        now = time.monotonic()
        for ref, (slot, kind) in list(self.calls.items()):
            if kind == "ready" and now - slot.started > self.pool.start_timeout:
                del self.calls[ref]
                self._drop(slot, f"it did not come back within {self.pool.start_timeout:.0f} s")

    def _drop(self, slot: _Slot, reason: str) -> None:
        slot.is_dead = True
        self.dispatcher.remove_replica(slot.index)
        with contextlib.suppress(Exception):
            ray.kill(slot.actor, no_restart=True)
        left = len(self.pool.live_slots)
        self.pool.notify(f"replica {slot.index} is gone for good ({reason}); {left} replica(s) left")

    def _write(self, finished: FinishedLine) -> None:
        self.writer.write(finished.record)
        self.progress.on_record(finished.usage, finished.is_error)


def _reason(error: BaseException) -> str:
    if isinstance(error, GetTimeoutError):
        return "timed out"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and "creation task" in lines[0]:
        lines = lines[-1:]  # the constructor's traceback: its last line is the exception
    text = _first_line(lines[0]) if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _first_line(text: str, limit: int = 300) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."
