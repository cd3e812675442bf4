"""`InFlightReads` alone (architecture.md §Chain, §Progress): the reads below the host run on real
I/O threads, held by an event; the clock is the test's. Who waits on which read, until when, and
what a landed (or failed) read frees; no host tier, no store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.offload.fetch import FetchJob, FetchResult
from kvtier.offload.in_flight import InFlightReads, Next

KEY = (0, b"first block")  # (group, block hash) a read starts at


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def job(req_id: str) -> FetchJob:
    return FetchJob(req_id, 0, 0, 16, [[]], frozenset(), [])


def held_read(gate: threading.Event, job: FetchJob) -> FetchResult:
    gate.wait(30)  # a hang guard only
    return FetchResult(job.start, job.max_len, job.max_len, [], [job.max_len], [True])


def failing_read(job: FetchJob) -> FetchResult:
    raise OSError("the store went away")


@pytest.fixture
def parts() -> Iterator[tuple[InFlightReads, Clock, threading.Event]]:
    clock, gate = Clock(), threading.Event()
    reads = InFlightReads(timeout_s=1.0, max_reads=2, num_threads=2, clock=clock)
    yield reads, clock, gate
    gate.set()
    reads.close()


def start(reads: InFlightReads, gate: threading.Event, req_id: str) -> FetchJob:
    assert reads.begin(req_id, 20, (0, 0)) is Next.ASK
    j = job(req_id)
    reads.start(j, [KEY], lambda jb: held_read(gate, jb))
    return j


def test_a_waiter_asks_again_once_the_read_it_waits_on_lands(
    parts: tuple[InFlightReads, Clock, threading.Event],
) -> None:
    reads, _, gate = parts
    a = start(reads, gate, "a")
    assert reads.begin("b", 20, (0, 0)) is Next.ASK
    assert reads.wait_on_other("b", [KEY])  # b's next block is the one a reads
    assert not reads.wait_on_other("a", [KEY])  # its own read is no other's
    assert reads.waiting() == {"a", "b"}
    assert reads.begin("b", 20, (0, 0)) is Next.WAIT
    assert reads.wait(0.01) is False
    gate.set()
    assert reads.wait(30) is True
    [(landed, result)] = reads.take_landed()
    assert landed is a and result is not None and result.boundary == 16
    assert reads.waiting() == set() and reads.take_landed() == []
    assert reads.begin("a", 20, (0, 16)) is Next.DONE  # asked once for this length
    assert reads.begin("b", 20, (0, 16)) is Next.ASK  # from the host's answer, now longer
    assert reads.take_result("a") is result and reads.take_result("a") is None
    assert reads.take_result("b") is None  # it read nothing itself
    assert reads.last_lookup("a") == (0, 16) and reads.last_lookup("c") is None


def test_a_read_that_raises_lands_as_none_and_frees_its_waiters(
    parts: tuple[InFlightReads, Clock, threading.Event],
) -> None:
    reads, _, _ = parts
    assert reads.begin("a", 20, (0, 0)) is Next.ASK
    reads.start(job("a"), [KEY], failing_read)
    assert reads.begin("b", 20, (0, 0)) is Next.ASK and reads.wait_on_other("b", [KEY])
    assert reads.wait(30) is True
    [(_, result)] = reads.take_landed()
    assert result is None
    assert reads.begin("a", 20, (0, 0)) is Next.DONE and reads.take_result("a") is None
    assert reads.begin("b", 20, (0, 0)) is Next.ASK


def test_past_the_deadline_the_lookup_stops_and_the_orphaned_read_ends_no_wait(
    parts: tuple[InFlightReads, Clock, threading.Event],
) -> None:
    reads, clock, gate = parts
    start(reads, gate, "a")
    clock.now = 0.99
    assert reads.begin("a", 20, (0, 0)) is Next.WAIT
    clock.now = 1.0
    assert reads.wait(0.01) is True  # the awaited deadline passed
    assert reads.begin("a", 20, (0, 0)) is Next.TIMED_OUT
    assert reads.begin("a", 20, (0, 0)) is Next.DONE
    assert reads.waiting() == set() and reads.wait(0.01) is False  # nobody waits on it
    assert reads.begin("a", 24, (0, 0)) is Next.ASK  # a new length is a new lookup
    reads.forget("a")
    assert reads.last_lookup("a") is None
    gate.set()
    assert [j.req_id for j, _ in _landed(reads)] == ["a"]  # still staged when it lands


def test_reads_not_yet_taken_count_against_the_bound(
    parts: tuple[InFlightReads, Clock, threading.Event],
) -> None:
    reads, _, gate = parts
    start(reads, gate, "a")
    assert not reads.full
    start(reads, gate, "b")
    assert reads.full
    gate.set()
    assert len(_landed(reads, 2)) == 2 and not reads.full


def _landed(reads: InFlightReads, n: int = 1) -> list[tuple[FetchJob, FetchResult | None]]:
    """Take landed reads until `n` have (the I/O threads finish on their own time)."""
    out: list[tuple[FetchJob, FetchResult | None]] = []
    for _ in range(3000):  # a hang guard only
        out += reads.take_landed()
        if len(out) >= n:
            return out
        time.sleep(0.01)
    raise AssertionError(f"{n} reads did not land")
