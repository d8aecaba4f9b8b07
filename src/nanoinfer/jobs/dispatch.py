"""Dispatcher: which input lines each engine replica runs, and what happens to them when a replica dies.

Plain bookkeeping, no Ray: the driver (ray_replicas.py) asks it for work whenever a replica has room, and
tells it which lines came back and which replica died. It reads the input lazily, so the driver holds at
most max_in_flight lines per replica, handed out HANDOUT_CHUNK at a time; a replica that finishes early simply
asks again sooner.

A dead replica's unfinished lines become a suspect group. A suspect group runs alone on one replica (it
waits for one to empty). If that replica dies too, the group is split in halves, each again run alone; a
line that kills a replica when it is the only one there gets an error record. So every line is retried at
most 1 + log2(max_in_flight) times, a line that only shared a replica with a poison one ends up alone and
finishes, and one poison line costs 2 + log2(its group's size) replica restarts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from nanoinfer.jsonl.lines import LineError
from nanoinfer.jsonl.requests import BatchRequest

# New lines a replica gets per call, at most: the first replica to ask must not take a whole small job while
# the others sit idle (benchmarks/README.md, Ray replicas), and a replica asks again with every call it returns
# (a fraction of a second of stepping), so a big one still fills up within seconds.
HANDOUT_CHUNK = 16


class Dispatcher:
    def __init__(self, items: Iterator[BatchRequest | LineError], max_in_flight: int, chunk: int = HANDOUT_CHUNK):
        self.items = items
        self.max_in_flight = max_in_flight
        self.chunk = chunk
        self.exhausted = False
        self.in_flight: dict[int, dict[int, BatchRequest]] = {}  # replica -> line -> request
        self.suspects: deque[list[BatchRequest]] = deque()  # groups of lines from dead replicas
        self.isolated: set[int] = set()  # replicas running one suspect group and nothing else
        self.draining: set[int] = set()  # replicas taking no new lines so that a suspect group can have them

    def add_replica(self, replica: int) -> None:
        self.in_flight.setdefault(replica, {})

    def remove_replica(self, replica: int) -> None:
        """A replica gone for good; fail() it first if it had lines."""
        assert not self.in_flight.get(replica), "fail() a replica before removing it"
        self.in_flight.pop(replica, None)
        self.isolated.discard(replica)
        self.draining.discard(replica)

    def num_in_flight(self, replica: int) -> int:
        return len(self.in_flight[replica])

    @property
    def is_done(self) -> bool:
        return self.exhausted and not self.suspects and not any(self.in_flight.values())

    def next_work(self, replica: int) -> tuple[list[BatchRequest], list[LineError]]:
        """New lines for `replica` (may be none), and input lines that are errors already (the caller writes them).

        Reads at most as many input lines as the replica has room for, errors included, so a file of bad lines
        is written a bounded chunk at a time: call again while it returns errors and no requests.
        """
        in_flight = self.in_flight[replica]
        if replica in self.isolated:
            if in_flight:
                return [], []
            self.isolated.discard(replica)  # its group is done
        if self.suspects:
            if not in_flight:
                self.draining.discard(replica)
                self.isolated.add(replica)
                group = self.suspects.popleft()
                in_flight.update((request.line, request) for request in group)
                return group, []
            if len(self.draining) < len(self.suspects):
                self.draining.add(replica)
        if replica in self.draining:
            if len(self.draining) <= len(self.suspects):
                return [], []
            self.draining.discard(replica)  # another replica took the group it was emptying for
        requests, errors = [], []
        for _ in range(min(self.chunk, self.max_in_flight - len(in_flight))):
            item = next(self.items, None)
            if item is None:
                self.exhausted = True
                break
            if isinstance(item, LineError):
                errors.append(item)
            else:
                in_flight[item.line] = item
                requests.append(item)
        return requests, errors

    def finished(self, replica: int, line: int) -> BatchRequest | None:
        """`replica` finished `line`: its request, or None if the line is no longer that replica's to finish."""
        return self.in_flight[replica].pop(line, None)

    def fail(self, replica: int) -> tuple[list[BatchRequest], list[BatchRequest]]:
        """`replica` died: (lines to retry, lines given up on). The replica may be used again once restarted."""
        lines = sorted(self.in_flight[replica].values(), key=lambda request: request.line)
        self.in_flight[replica] = {}
        was_isolated = replica in self.isolated
        self.isolated.discard(replica)
        self.draining.discard(replica)
        if not lines:
            return [], []
        if not was_isolated:
            self.suspects.append(lines)
            return lines, []
        if len(lines) == 1:
            return [], lines  # it killed a replica while alone there, after being on one that died before
        half = (len(lines) + 1) // 2
        self.suspects.extend([lines[:half], lines[half:]])
        return lines, []
