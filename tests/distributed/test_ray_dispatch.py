"""The Dispatcher (who runs which line under --data-parallel-size), with exact expectations and no Ray: work
is handed out on demand up to max_in_flight, a dead replica's lines are retried apart from other work, and a
line that keeps killing replicas is given up while every other line finishes exactly once."""

from __future__ import annotations

import math
import random

from nanoinfer.jobs.dispatch import Dispatcher
from nanoinfer.jsonl.lines import NATIVE, LineError
from nanoinfer.jsonl.requests import BatchRequest
from nanoinfer.sampling_params import SamplingParams


def request(line: int) -> BatchRequest:
    return BatchRequest(line, f"id{line}", NATIVE, SamplingParams(max_tokens=4), prompt=f"p{line}")


def bad_line(line: int) -> LineError:
    return LineError(line, f"id{line}", NATIVE, "invalid_json", f"line {line}: is not valid JSON")


def dispatcher(items, max_in_flight: int, num_replicas: int) -> Dispatcher:
    d = Dispatcher(iter(items), max_in_flight)
    for replica in range(num_replicas):
        d.add_replica(replica)
    return d


def lines(requests) -> list[int]:
    return [r.line for r in requests]


def test_each_replica_gets_up_to_max_in_flight_and_more_as_soon_as_it_has_room():
    d = dispatcher([request(i) for i in range(1, 11)], max_in_flight=3, num_replicas=2)
    assert lines(d.next_work(0)[0]) == [1, 2, 3]
    assert lines(d.next_work(1)[0]) == [4, 5, 6]
    assert d.next_work(1) == ([], [])  # full: nothing read
    # Replica 0 is the faster one: it finishes two lines and takes the next two, in input order.
    assert lines([d.finished(0, 1), d.finished(0, 2)]) == [1, 2]
    assert lines(d.next_work(0)[0]) == [7, 8]
    assert d.num_in_flight(0) == 3 and d.num_in_flight(1) == 3
    assert not d.is_done


def test_bad_input_lines_come_back_as_errors_at_most_max_in_flight_at_a_time():
    items = [bad_line(i) for i in range(1, 6)] + [request(6), request(7)]
    d = dispatcher(items, max_in_flight=3, num_replicas=1)
    requests, errors = d.next_work(0)
    assert (requests, lines(errors)) == ([], [1, 2, 3])  # a file of bad lines never piles up in memory
    requests, errors = d.next_work(0)
    assert (lines(requests), lines(errors)) == ([6], [4, 5])
    requests, errors = d.next_work(0)
    assert (lines(requests), errors) == ([7], [])
    assert d.exhausted and not d.is_done  # 6 and 7 are still in flight
    d.finished(0, 6), d.finished(0, 7)
    assert d.is_done


def test_a_dead_replicas_lines_run_alone_on_the_first_replica_that_empties():
    d = dispatcher([request(i) for i in range(1, 21)], max_in_flight=2, num_replicas=3)
    assert [lines(d.next_work(r)[0]) for r in range(3)] == [[1, 2], [3, 4], [5, 6]]
    assert lines(d.fail(0)[0]) == [1, 2]
    # Replica 1 asks first: it stops taking new lines so that it empties for the suspects; replica 2 need not.
    assert d.next_work(1) == ([], [])
    assert d.finished(2, 5) is not None
    assert lines(d.next_work(2)[0]) == [7]
    d.finished(1, 3), d.finished(1, 4)
    assert lines(d.next_work(1)[0]) == [1, 2]  # empty now: it takes the group, and only the group
    d.finished(1, 1)
    assert d.next_work(1) == ([], [])  # line 2 of the group still runs: nothing joins it
    d.finished(1, 2)
    assert lines(d.next_work(1)[0]) == [8, 9]  # the group is done: back to the input
    assert lines(d.next_work(0)[0]) == [10, 11]  # the restarted replica 0 takes input lines too


def test_a_line_no_longer_assigned_to_a_replica_is_not_finished_twice():
    d = dispatcher([request(1), request(2)], max_in_flight=2, num_replicas=2)
    d.next_work(0)
    d.fail(0)  # e.g. its connection was lost while it was still running the lines
    assert d.finished(0, 1) is None  # what it returns late is not written
    assert lines(d.next_work(1)[0]) == [1, 2]
    assert d.finished(1, 1).line == 1 and d.finished(1, 1) is None


def test_a_replica_that_dies_idle_leaves_nothing_to_retry():
    d = dispatcher([request(1)], max_in_flight=2, num_replicas=2)
    assert d.fail(1) == ([], [])
    assert not d.suspects
    assert lines(d.next_work(1)[0]) == [1]


def simulate(num_lines: int, poison: set[int], max_in_flight: int, num_replicas: int, seed: int):
    """Replicas that finish a random line or two each tick and die on any tick they hold a poison line."""
    rng = random.Random(seed)
    d = dispatcher([request(i) for i in range(1, num_lines + 1)], max_in_flight, num_replicas)
    written: list[int] = []
    given_up: list[int] = []
    retries = {line: 0 for line in range(1, num_lines + 1)}
    first_groups, deaths = [], 0
    for _ in range(10_000):
        if d.is_done:
            break
        for replica in rng.sample(range(num_replicas), num_replicas):
            d.next_work(replica)
            held = set(d.in_flight[replica])
            if held & poison:
                if replica not in d.isolated:
                    first_groups.append(len(held))
                deaths += 1
                retried, lost = d.fail(replica)
                for r in retried:
                    retries[r.line] += 1
                given_up += lines(lost)
                continue
            for line in rng.sample(sorted(held), min(len(held), rng.randint(1, 2))):
                assert d.finished(replica, line) is not None
                written.append(line)
    assert d.is_done
    return written, given_up, retries, first_groups, deaths


def test_a_poison_line_is_given_up_and_every_other_line_is_written_exactly_once():
    written, given_up, retries, first_groups, deaths = simulate(
        num_lines=60, poison={23}, max_in_flight=8, num_replicas=3, seed=0
    )
    assert given_up == [23]
    assert sorted(written) == [line for line in range(1, 61) if line != 23]  # exactly once each
    # One death in company, then the group alone, then each half holding the poison line, down to it alone.
    assert len(first_groups) == 1
    assert deaths == 2 + math.ceil(math.log2(first_groups[0]))
    assert max(retries.values()) <= 1 + math.ceil(math.log2(8))


def test_two_poison_lines_in_one_group_are_both_given_up_and_nothing_else():
    for seed in range(5):
        written, given_up, retries, _, _ = simulate(
            num_lines=40, poison={5, 6}, max_in_flight=8, num_replicas=2, seed=seed
        )
        assert sorted(given_up) == [5, 6]
        assert sorted(written) == [line for line in range(1, 41) if line not in (5, 6)]
        assert max(retries.values()) <= 1 + math.ceil(math.log2(8))


def test_a_small_job_is_shared_not_taken_whole_by_the_first_replica():
    d = Dispatcher(iter([request(i) for i in range(1, 41)]), max_in_flight=2048, chunk=16)
    d.add_replica(0)
    d.add_replica(1)
    assert [len(d.next_work(r)[0]) for r in (0, 1, 0, 1, 0)] == [16, 16, 8, 0, 0]
