"""The reads below the host in flight and who waits on them (architecture.md §Chain, §Progress).

Each waiting request's lookup below the host, for its current length: the read it started on an
I/O thread, or another request's read it waits on (the one that reads its next block), the
deadline past which it stops waiting, and the answer once the read landed. Owns the I/O threads
and this state only; knows neither the host tier nor the stores (the chain decides what a read
asks and what its answer becomes). Call on the engine thread; torch-free.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvtier.ids import ReqId
from kvtier.offload.fetch import FetchJob, FetchResult
from kvtier.offload.types import Key

log = logging.getLogger("kvtier.offload")


class Next(enum.Enum):
    """What a request's lookup does next (`InFlightReads.begin`)."""

    WAIT = "wait"  # its read, or the one it waits on, is in flight before the deadline
    TIMED_OUT = "timed_out"  # that read passed the deadline: the request stops waiting
    DONE = "done"  # asked once already for this length (or had nothing to ask)
    ASK = "ask"  # nothing pending: the chain may start a read or wait on another's


@dataclass(slots=True)
class _Read:
    job: FetchJob
    future: Future[FetchResult]
    deadline: float


@dataclass(slots=True)
class _Lookup:
    """One waiting request's lookup below the host, for its current length."""

    num_tokens: int
    read: _Read | None = None  # its own read in flight
    waiting_on: _Read | None = None  # another request's read it waits for
    done: bool = False  # asked once already (or nothing to ask): no new read
    result: FetchResult | None = None  # its read's answer, for the metrics at admission
    last_lookup: tuple[int, int] = (0, 0)  # (device hit, host end) of its last lookup
    counted: bool = False  # its answer was taken for the metrics


class InFlightReads:
    """Reads below the host and the lookups waiting on them.

    `timeout_s`: the longest a lookup waits, however many blocks its read asks for.
    `max_reads`: reads in flight or landed but not yet taken, at most (`full`). `clock`: seconds,
    monotonic.
    """

    def __init__(
        self,
        timeout_s: float,
        max_reads: int,
        num_threads: int,
        clock: Callable[[], float],
    ) -> None:
        self.timeout_s = timeout_s
        self.max_reads = max_reads
        self.clock = clock
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kvtier-tier-fetch")
        self._reads: list[_Read] = []  # in flight or landed, not yet taken
        self._by_key: dict[Key, _Read] = {}  # first key of each group at a read's start
        self._lookups: dict[ReqId, _Lookup] = {}

    def begin(self, req_id: ReqId, num_tokens: int, last_lookup: tuple[int, int]) -> Next:
        """Note a lookup of `req_id` at `num_tokens` that saw (device hit, host end)
        `last_lookup`; what it does next. A new length starts a new lookup. TIMED_OUT ends the
        wait (the read stays in flight for whoever stages it; it ends no `wait`)."""
        st = self._lookups.get(req_id)
        if st is None or st.num_tokens != num_tokens:
            st = self._lookups[req_id] = _Lookup(num_tokens)
        st.last_lookup = last_lookup
        now = self.clock()
        for pending in (st.read, st.waiting_on):
            if pending is None:
                continue
            if now < pending.deadline:
                return Next.WAIT
            st.read = st.waiting_on = None
            st.done = True
            return Next.TIMED_OUT
        return Next.DONE if st.done else Next.ASK

    def settle(self, req_id: ReqId) -> None:
        """The lookup of `req_id` (after ASK) asks nothing below the host for this length."""
        self._lookups[req_id].done = True

    @property
    def full(self) -> bool:
        """As many reads as allowed are in flight or not yet taken: a new lookup asks nothing."""
        return len(self._reads) >= self.max_reads

    def wait_on_other(self, req_id: ReqId, keys: Iterable[Key]) -> bool:
        """Make `req_id` (after ASK) wait on another request's read in flight that starts at one
        of `keys` (the first block it would ask for in each group); False when none does."""
        for key in keys:
            read = self._by_key.get(key)
            if read is not None and read.job.req_id != req_id:
                self._lookups[req_id].waiting_on = read
                return True
        return False

    def start(
        self,
        job: FetchJob,
        keys: Iterable[Key],
        run: Callable[..., FetchResult],
        *args: object,
    ) -> None:
        """Run `run(job, *args)` on an I/O thread for `job.req_id` (after ASK), which waits on it
        until the deadline; other lookups starting at one of `keys` wait on it too."""
        read = _Read(job, self._pool.submit(run, job, *args), self.clock() + self.timeout_s)
        self._lookups[job.req_id].read = read
        self._reads.append(read)
        for key in keys:
            self._by_key[key] = read

    def take_landed(self) -> list[tuple[FetchJob, FetchResult | None]]:
        """Every read that finished since the last call, with its answer (None: it raised,
        logged here). The request that started it is DONE for its length; those that waited on
        it ASK again (from the host's answer, which then holds what the chain staged)."""
        landed: list[tuple[FetchJob, FetchResult | None]] = []
        still: list[_Read] = []
        for read in self._reads:
            if not read.future.done():
                still.append(read)
                continue
            for key, owner in list(self._by_key.items()):
                if owner is read:
                    del self._by_key[key]
            try:
                result: FetchResult | None = read.future.result()
            except Exception:
                log.exception("a lookup below the host failed; the request recomputes")
                result = None
            st = self._lookups.get(read.job.req_id)
            if st is not None and st.read is read:
                st.read, st.done, st.result = None, True, result
            for other in self._lookups.values():
                if other.waiting_on is read:
                    other.waiting_on = None
            landed.append((read.job, result))
        self._reads = still
        return landed

    def last_lookup(self, req_id: ReqId) -> tuple[int, int] | None:
        """(device hit, host end) of the request's last lookup; None when it had none."""
        st = self._lookups.get(req_id)
        return None if st is None else st.last_lookup

    def take_result(self, req_id: ReqId) -> FetchResult | None:
        """The answer of the request's own read, once per lookup (None: none, or taken)."""
        st = self._lookups.get(req_id)
        if st is None or st.result is None or st.counted:
            return None
        st.counted = True
        return st.result

    def forget(self, req_id: ReqId) -> None:
        """Drop the request's lookup; a read it started stays in flight until taken."""
        self._lookups.pop(req_id, None)

    def waiting(self) -> set[ReqId]:
        """Requests whose lookup waits for a read (reads only)."""
        return {rid for rid, st in self._lookups.items() if st.read or st.waiting_on}

    def wait(self, max_wait_s: float) -> bool:
        """Block up to `max_wait_s` until a read some request waits on finishes or its deadline
        passes. True when one has, False when all still wait. Reads no request waits on any more
        (aborted, or its lookup timed out) end no wait: past their deadline they would end every
        wait at once, a busy spin (architecture.md §Progress). Mutates nothing."""
        awaited = {
            id(r): r for st in self._lookups.values() for r in (st.read, st.waiting_on) if r
        }.values()
        if not awaited:
            return False
        if any(r.future.done() for r in awaited):
            return True
        deadline = min(r.deadline for r in awaited)
        timeout = min(max_wait_s, max(0.0, deadline - self.clock()))
        wait([r.future for r in awaited], timeout, FIRST_COMPLETED)
        return any(r.future.done() for r in awaited) or self.clock() >= deadline

    def close(self) -> None:
        """Stop the I/O threads; reads not started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
