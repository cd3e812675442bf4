"""Streams as worker threads, shared by the cpu and cuda backends: each stream runs its ops in
launch order on its own thread, off the host thread, so the host schedules and processes steps
while a forward runs; events are completion objects; a failed op is a sticky `DeviceError`.

A backend adds what its hardware needs through four hooks that run on the workers: the context an
op runs in (a CUDA stream), a mark left at a record (a CUDA event), how a waiting stream orders
itself after a mark, and whether a mark is done. On the cpu backend an op has finished when its
worker moves on, so a mark is nothing and a record is done once its worker reaches it."""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.device.base import Device, DeviceError, OpFn
from kvtier.device.costs import Work
from kvtier.device.sanitizer import SanitizerMode
from kvtier.device.types import KVLayout, OpMeta
from kvtier.ids import EventId, OpId, StreamId

log = logging.getLogger("kvtier.device")

Item = Callable[[], object]


class _Completion:
    """One record of an event. `issued` is set when the recording stream's worker reaches the
    record; `mark` is what the backend left there (None on cpu: reaching it means done)."""

    __slots__ = ("issued", "mark")

    def __init__(self) -> None:
        self.issued = threading.Event()
        self.mark: object = None


class _Failure:
    """The first op failure of a device (sticky, as a CUDA error is): later ops are skipped so
    nothing runs on state a failed op left half-written; records still fire, so no one hangs."""

    __slots__ = ("error", "label")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.label = ""


@dataclass(slots=True)
class StreamTimes:
    """Where time went on a threaded device, in seconds since it was built: each stream's worker
    busy running ops, and the host blocked in synchronisations. With host work overlapped, a run's
    compute busy time minus the host's wait is the host time hidden behind forwards."""

    busy_s: dict[str, float] = field(default_factory=dict)  # per stream name
    host_wait_s: float = 0.0


def _run(items: queue.SimpleQueue[Item | None]) -> None:
    # Holds no reference to the device, so an unused device is collected and its workers stopped.
    while (item := items.get()) is not None:
        item()


STOP_JOIN_S = 60.0  # how long closing (or the interpreter's exit) waits for a worker's ops


def _stop_all(
    queues: list[queue.SimpleQueue[Item | None]], threads: list[threading.Thread]
) -> None:
    """Stop every worker once it has run what was launched, and wait for it. Also the exit hook
    (`weakref.finalize` runs at interpreter exit): a daemon worker still inside a torch op when
    the interpreter finalizes is unwound by `pthread_exit` through torch's C++ frames as it
    retakes the GIL, which aborts the process (tests/device/test_cpu_async.py)."""
    for q in queues:
        q.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(STOP_JOIN_S)


class ThreadedDevice(Device):
    """A `Device` whose streams are worker threads. Subclasses allocate memory (`_alloc`) and
    may override the worker hooks `_run_op`, `_mark`, `_order_after`, `_mark_done`, `_mark_sync`.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        sanitize: SanitizerMode | None = "raise",
        poison: bool = False,
    ) -> None:
        self._failure = _Failure()
        self._queues: dict[StreamId, queue.SimpleQueue[Item | None]] = {}
        self._threads: dict[StreamId, threading.Thread] = {}
        self._completions: dict[EventId, _Completion] = {}  # each event's latest record
        self._times = StreamTimes()
        all_queues: list[queue.SimpleQueue[Item | None]] = []  # filled as streams appear
        all_threads: list[threading.Thread] = []
        self._all_queues, self._all_threads = all_queues, all_threads
        self._finalizer = weakref.finalize(self, _stop_all, all_queues, all_threads)
        super().__init__(
            layout, num_device_blocks, num_host_blocks, sanitize=sanitize, poison=poison
        )

    def close(self) -> None:
        """Stop the stream workers once they have run what was launched, and wait for them
        (idempotent)."""
        self._finalizer()

    def times(self) -> StreamTimes:
        """A copy of the busy and wait times so far (see `StreamTimes`)."""
        return StreamTimes(dict(self._times.busy_s), self._times.host_wait_s)

    def stream_threads(self) -> list[threading.Thread]:
        """The worker thread of each stream (for tests and debugging)."""
        return list(self._threads.values())

    # -- backend hooks, run on the stream's worker -------------------------------------------

    def _worker_setup(self, stream: StreamId) -> None:
        """First item on a new worker (e.g. select the GPU)."""

    def _run_op(self, stream: StreamId, fn: OpFn) -> None:
        fn()

    def _mark(self, stream: StreamId) -> object:
        """Left at a record on `stream` once everything before it is issued; None = done now."""
        return None

    def _order_after(self, stream: StreamId, mark: object) -> None:
        """Make later work on `stream` start after `mark` (its record is issued already)."""

    def _mark_done(self, mark: object) -> bool:
        return True

    def _mark_sync(self, mark: object) -> None:
        """Block the calling thread until `mark` is done."""

    # -- Device hooks --------------------------------------------------------------------------

    def _new_stream(self, stream: StreamId) -> None:
        items: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        name = f"kvtier-{self.kind}-stream{int(stream)}"
        thread = threading.Thread(target=_run, args=(items,), name=name, daemon=True)
        self._queues[stream] = items
        self._threads[stream] = thread
        self._all_queues.append(items)
        self._all_threads.append(thread)
        thread.start()
        items.put(lambda: self._worker_setup(stream))

    def _new_event(self, event: EventId) -> None:
        pass  # an unrecorded event has no completion: waits ignore it, queries say done

    def _release_event(self, event: EventId) -> None:
        self._completions.pop(event, None)

    def _launch(
        self, stream: StreamId, op_id: OpId, fn: OpFn, meta: OpMeta, work: Work | None
    ) -> None:
        self._check_failure()
        failure, busy, name = self._failure, self._times.busy_s, self.stream_name(stream)

        def op() -> None:
            if failure.error is not None:
                return  # the device failed: skip, as a CUDA context would
            t0 = time.perf_counter()
            try:
                self._run_op(stream, fn)
            except BaseException as exc:  # reported to the host at its next device call
                log.exception("device op %s (step %s) failed", meta.label, meta.step_seq)
                failure.label = f"{meta.label} (op {int(op_id)}, step {meta.step_seq})"
                failure.error = exc
            busy[name] = busy.get(name, 0.0) + time.perf_counter() - t0  # this worker only

        self._queues[stream].put(op)

    def _record(self, stream: StreamId, event: EventId) -> None:
        self._completions[event] = self._put_record(stream)

    def _put_record(self, stream: StreamId) -> _Completion:
        done = _Completion()

        def record() -> None:
            try:
                done.mark = self._mark(stream)
            finally:
                done.issued.set()

        self._queues[stream].put(record)
        return done

    def _wait(self, stream: StreamId, event: EventId) -> None:
        done = self._completions.get(event)  # the record as of now, as CUDA's wait_event
        if done is None or (done.issued.is_set() and self._mark_done(done.mark)):
            return

        def wait() -> None:
            done.issued.wait()
            if done.mark is not None:
                self._order_after(stream, done.mark)

        self._queues[stream].put(wait)

    def _query(self, event: EventId) -> bool:
        self._check_failure()
        done = self._completions.get(event)
        return done is None or (done.issued.is_set() and self._mark_done(done.mark))

    def _sync_event(self, event: EventId) -> None:
        done = self._completions.get(event)
        if done is not None:
            self._block_on(done)
        self._check_failure()

    def _sync_stream(self, stream: StreamId) -> None:
        self._block_on(self._put_record(stream))
        self._check_failure()

    def _block_on(self, done: _Completion) -> None:
        t0 = time.perf_counter()
        done.issued.wait()
        if done.mark is not None:
            self._mark_sync(done.mark)
        self._times.host_wait_s += time.perf_counter() - t0

    def _sync_all(self) -> None:
        for stream in list(self._queues):
            self._sync_stream(stream)

    def _host_run(self, fn: OpFn) -> None:
        self._check_failure()
        fn()

    def _check_failure(self) -> None:
        failure = self._failure
        if failure.error is not None:
            raise DeviceError(
                f"a {self.kind} device op failed: {failure.label}: {failure.error!r}"
            ) from failure.error
