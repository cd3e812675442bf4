"""Counters and latency histograms of one block store, as plain numbers a metrics exporter reads
(`snapshot`). Thread-safe: the caller's thread and the store's I/O threads all count here."""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field, fields

# Upper bounds in seconds (Prometheus-style `le` buckets; one more count for +Inf).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


@dataclass(frozen=True, slots=True)
class Histogram:
    """`counts[i]`: observations ≤ `buckets[i]` and above the bucket before (not cumulative);
    `counts[-1]`: above the last bucket."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a store's counters. Blocks are counted one per key."""

    num_queries: int = 0  # keys asked for by get and contains
    num_hits: int = 0  # keys found intact
    num_puts: int = 0  # blocks written
    num_dropped: int = 0  # blocks not written: back-pressure, full disk, errors, too large
    num_refused: int = 0  # blocks not written because the server is full (Redis out of memory)
    num_errors: int = 0  # failed I/O operations (a batch counts once)
    num_timeouts: int = 0  # batches answered with misses because their deadline passed
    num_corrupt: int = 0  # stored values that failed their frame checks (then deleted)
    num_evicted: int = 0  # blocks the store evicted to stay within its size
    bytes_in: int = 0  # frame bytes written into the store
    bytes_out: int = 0  # frame bytes read out of it on hits
    get_latency: Histogram = field(
        default_factory=lambda: Histogram(LATENCY_BUCKETS_S, (0,) * 15, 0.0)
    )
    put_latency: Histogram = field(
        default_factory=lambda: Histogram(LATENCY_BUCKETS_S, (0,) * 15, 0.0)
    )


_COUNTERS = tuple(f.name for f in fields(StoreStats) if f.type == "int")


class StoreMetrics:
    """The live counters behind `StoreStats`; `count` and `observe_*` mutate them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        n = len(LATENCY_BUCKETS_S) + 1
        self._hist: dict[str, list[int]] = {"get": [0] * n, "put": [0] * n}
        self._sums = {"get": 0.0, "put": 0.0}

    def count(self, **increments: int) -> None:
        """Add `increments` (StoreStats counter names) to the counters."""
        with self._lock:
            for name, n in increments.items():
                self._counts[name] += n

    def observe(self, op: str, seconds: float) -> None:
        """Record one batch latency of `op` ("get" or "put")."""
        i = bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            self._hist[op][i] += 1
            self._sums[op] += seconds

    def snapshot(self) -> StoreStats:
        """The counters now."""
        with self._lock:
            hists = {
                op: Histogram(LATENCY_BUCKETS_S, tuple(c), self._sums[op])
                for op, c in self._hist.items()
            }
            return StoreStats(**self._counts, get_latency=hists["get"], put_latency=hists["put"])
