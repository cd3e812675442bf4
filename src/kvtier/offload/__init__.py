"""The host-memory KV tier. Scheduler half (torch-free): `HostTier`, a `sched.connector.KVTier` —
lookup extending device hits, load and store planning from settled counts, chain-aware host
eviction, re-store after eviction, completion and failure decisions, metrics."""

from kvtier.offload.host_cache import HostCache
from kvtier.offload.store_records import StoreProgress
from kvtier.offload.tier import HostTier, lazy_scan_blocks_for
from kvtier.offload.types import HostTierMetrics, Key, Transfer

__all__ = [
    "HostCache",
    "HostTier",
    "HostTierMetrics",
    "Key",
    "StoreProgress",
    "Transfer",
    "lazy_scan_blocks_for",
]
