"""A small pool of writer threads behind a queue bounded in bytes: `submit` never blocks, it
refuses work past the bound (the caller counts the drop), so a slow disk or network never stalls
the thread that stores."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("kvtier.stores")

Job = TypeVar("Job")


class BoundedWriter(Generic[Job]):
    """Runs `handle(job)` on `num_threads` daemon threads, first in first out.

    INVARIANT: `_num_jobs` counts the jobs queued or running, `_pending_bytes` their sizes.
    """

    def __init__(
        self, name: str, handle: Callable[[Job], None], num_threads: int, max_pending_bytes: int
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes}")
        self._handle = handle
        self._max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._queue: deque[tuple[Job, int]] = deque()
        self._num_jobs = 0
        self._pending_bytes = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def room(self) -> int:
        """Bytes `submit` accepts now."""
        with self._cond:
            return 0 if self._closed else self._max_pending_bytes - self._pending_bytes

    def submit(self, job: Job, num_bytes: int) -> bool:
        """Queue `job` of `num_bytes`; False (nothing queued) when that would pass the bound or
        the writer is closed."""
        with self._cond:
            if self._closed or self._pending_bytes + num_bytes > self._max_pending_bytes:
                return False
            self._queue.append((job, num_bytes))
            self._num_jobs += 1
            self._pending_bytes += num_bytes
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; False if `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_jobs == 0, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop taking jobs, run the queued ones and join the threads (at most `timeout` each)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                job, num_bytes = self._queue.popleft()
            try:
                self._handle(job)
            except Exception:  # a handler must count its own failures; never lose the thread
                log.exception("store writer job failed")
            finally:
                with self._cond:
                    self._num_jobs -= 1
                    self._pending_bytes -= num_bytes
                    self._cond.notify_all()
