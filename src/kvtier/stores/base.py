"""The `BlockStore` protocol: byte-level storage of KV blocks by `StoreKey`, the layer the disk and
remote tiers sit on. A store knows keys and bytes only: no requests, device blocks or torch.

Contract every implementation keeps: a miss is never an error (absent, evicted, corrupt,
unreachable and late all read as None); `put` never blocks on I/O (it queues, or drops and
counts); every store is safe to call from several threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.stores.keys import StoreKey
from kvtier.stores.metrics import StoreStats


class BlockStore(Protocol):
    """Batch get / put / contains of framed KV blocks."""

    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        """The payload stored under each key, or None (a miss). Counts queries, hits, bytes
        out and the batch latency; a corrupt value is deleted and counted."""
        ...

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is stored now (a later get may still miss: eviction, corruption)."""
        ...

    def put(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        """Queue `items` (key, payload), given in chain order (a chain's head first), for writing
        in the background; returns how many were queued. The rest are dropped and counted
        (back-pressure): a store is a cache, and a dropped block is recomputed. Keys already
        stored are not written again and count as queued."""
        ...

    def watch_removals(self, fn: Callable[[list[StoreKey]], None]) -> None:
        """From now on, call `fn(keys)` (on any thread, no lock held) with the keys given to
        `put` that the store does not hold, or no longer: dropped, failed, evicted, deleted as
        corrupt. Keys it never reports may still vanish unseen (an expiry on a shared server).
        For KV events."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has finished; False if `timeout` seconds passed."""
        ...

    def close(self) -> None:
        """Finish queued writes and release threads, files and connections."""
        ...

    def stats(self) -> StoreStats:
        """The store's counters now."""
        ...
