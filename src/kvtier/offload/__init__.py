"""The host-memory KV tier. Scheduler half (torch-free): `HostTier` — lookup extending device
hits, load and store planning from settled counts, chain-aware host eviction, re-store after
eviction, completion and failure handling, metrics."""

from kvtier.offload.host_cache import HostCache
from kvtier.offload.store_records import StoreProgress
from kvtier.offload.tier import HostTier, lazy_scan_blocks_for
from kvtier.offload.types import HostLookup, HostTierMetrics, Key, LoadFailure, Transfer

__all__ = [
    "HostCache",
    "HostLookup",
    "HostTier",
    "HostTierMetrics",
    "Key",
    "LoadFailure",
    "StoreProgress",
    "Transfer",
    "lazy_scan_blocks_for",
]
