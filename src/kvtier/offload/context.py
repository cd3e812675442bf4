"""What the host tier's planners share: the device's KV manager (pins go through it), the host
cache, the KV-cache group layout, the metrics and the transfer-id counter.

Built once by `HostTier`; holds no request state and knows neither planner, so `loads.py`,
`stores.py` and `lookup.py` depend on it and never on the tier. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.kv.coordinator import KVCacheCoordinator
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.specs import FullAttention, KVSpec
from kvtier.offload.host_cache import HostCache
from kvtier.offload.types import HostTierMetrics


class HostContext:
    """The fixed parts of one host tier and its shared counters."""

    def __init__(
        self,
        device_kv: KVCacheManager,
        host: HostCache,
        bytes_per_block: Sequence[int],
        world_size: int,
    ) -> None:
        self.device_kv = device_kv  # the device tier's KV manager: tables, pins, its cache
        self.specs: list[KVSpec] = list(device_kv.specs)
        self.host = host
        # Host-side groups over the host pool: hashes per group and the common alignment.
        self.coordinator = KVCacheCoordinator(self.specs, host.pool)
        self.bytes_per_block = list(bytes_per_block)
        self.world_size = world_size  # a transfer completes when every worker reported it
        self.chained = [isinstance(s, FullAttention) for s in self.specs]
        self.metrics = HostTierMetrics()
        self._last_transfer_id = 0

    def new_transfer_id(self) -> int:
        """A transfer id never used before by this tier (monotonic; mutates)."""
        self._last_transfer_id += 1
        return self._last_transfer_id

    def block_end(self, group_id: int, position: int) -> int:
        """The token count at which table position `position` of group `group_id` ends."""
        return (position + 1) * self.specs[group_id].block_size
