"""Plain records of the host tier: cache keys, transfers and the metrics. (Lookup answers and load
failures are the scheduler's: `sched/connector.py`.) Torch-free data only."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.ids import BlockHash
from kvtier.sched.output import PlannedTransfer

Key = tuple[int, BlockHash]  # (KV-cache group id, chained block hash): one host-cache entry


@dataclass(slots=True)
class Transfer:
    """One planned copy between the device and the host tier, for one request (or lazy: none).

    Pairs are parallel lists; `group_ids[i]` is the KV-cache group of pair i. Loads copy host →
    device (src = host ids), stores device → host (src = device ids). Ids are monotonic and never
    reused, so completions may arrive in any order and after a reset.
    """

    transfer_id: int
    req_id: str  # "" for lazy-mode stores, which serve no single request
    is_load: bool
    group_ids: list[int]
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    def planned(self) -> PlannedTransfer:
        """The step-contract form carried in `SchedulerOutput.planned_transfers`."""
        return PlannedTransfer(
            self.transfer_id,
            self.req_id,
            list(self.src_block_ids),
            list(self.dst_block_ids),
            self.is_load,
        )


@dataclass(slots=True)
class HostTierMetrics:
    """Counters of the host tier (monotonic except the two `pending` gauges)."""

    num_queries: int = 0  # lookups answered
    num_query_tokens: int = 0  # tokens asked of the host tier (beyond the device hit)
    num_hit_tokens: int = 0  # tokens the host tier offered
    num_load_waits: int = 0  # lookups told to wait on another request's in-flight load
    num_stored_blocks: int = 0  # completed store copies (blocks)
    num_stored_bytes: int = 0
    num_loaded_blocks: int = 0  # completed load copies (blocks)
    num_loaded_bytes: int = 0
    num_deduped_blocks: int = 0  # store candidates already cached or in flight on the host
    num_evicted_blocks: int = 0  # host-cache entries evicted to make room
    num_orphans_demoted: int = 0  # host blocks moved to the LRU head because their chain broke
    num_restored_blocks: int = 0  # re-stores planned after eviction
    num_failed_loads: int = 0
    num_failed_stores: int = 0
    # store candidates not planned: no allocatable host block (lazy: none but ones the device
    # still caches, which a lazy store never evicts)
    num_skipped_pinned_full: int = 0
    num_pending_loads: int = 0  # gauge: load transfers in flight
    num_pending_stores: int = 0  # gauge: store transfers in flight

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
