"""`EngineStats`: a frozen snapshot of one engine's requests, steps, copies and KV pools
(`EngineCore.stats()`), built only from public methods of the scheduler, the KV manager, the host
tier and the transfer engine. Torch-free; it never holds a reference to live state."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.kv.manager import KVCacheManager, PrefixCacheStats
from kvtier.kv.stats import PoolStats
from kvtier.offload import HostTier, HostTierMetrics
from kvtier.offload.chain import TierStats
from kvtier.sched.request import RequestStatus
from kvtier.sched.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine holds at one moment. `is_idle` is the one call for "nothing left behind"."""

    device: PoolStats  # the device pool, with the pins of copies in flight
    host: PoolStats | None  # the host tier's pool (None without a host tier)
    num_requests: int  # added and not yet handed back finished (or aborted)
    num_waiting: int  # queued requests not loading (preempted ones included)
    num_loading: int  # requests waiting for their host → device load
    num_running: int
    num_steps: int  # steps scheduled so far
    num_steps_in_flight: int  # scheduled, not yet processed
    num_pending_loads: int  # load transfers not yet completed (cancelled ones included)
    num_pending_stores: int  # store transfers not yet completed
    num_pending_copies: int  # copies launched on the device and not yet reported
    num_preemptions: int
    num_draft_tokens: int  # n-gram drafts verified so far
    num_accepted_tokens: int  # of which accepted
    hazards: dict[str, int]  # races the device's sanitizer found, by kind (RAW, WAR, WAW)
    device_time_ns: int | None  # the simulated device's virtual clock (None on cpu and cuda)
    prefix_cache: PrefixCacheStats  # device prefix cache, counted once per admission
    host_metrics: HostTierMetrics | None  # counters of the host tier (a copy)
    host_store_mode: str | None  # the host tier's store mode, "eager" or "lazy" (None: no tier)
    tiers: tuple[TierStats, ...] = ()  # the tiers below the host, in lookup order (disk, remote)
    # the native kernel pool's counters in this process (`native.pool_stats`): calls run with
    # helpers, calls run alone while helpers did not pay, spells alone begun
    kernel_pool: dict[str, int] = field(default_factory=dict)

    def tier(self, name: str) -> TierStats | None:
        """The lower tier called `name` ("disk", "remote"), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def num_unfinished_requests(self) -> int:
        return self.num_waiting + self.num_loading + self.num_running

    @property
    def num_hazards(self) -> int:
        """Races found so far (0 without a sanitizer)."""
        return sum(self.hazards.values())

    @property
    def is_idle(self) -> bool:
        """No request, step or copy in flight, and no block referenced on any tier: every block
        is free or an unreferenced prefix-cache entry (what a drained engine must look like)."""
        return (
            self.num_requests == 0
            and self.num_unfinished_requests == 0
            and self.num_steps_in_flight == 0
            and self.num_pending_loads == 0
            and self.num_pending_stores == 0
            and self.num_pending_copies == 0
            and self.device.is_idle
            and (self.host is None or self.host.is_idle)
        )


def collect_stats(
    scheduler: Scheduler,
    kv: KVCacheManager,
    host_tier: HostTier | None,
    *,
    num_requests: int,
    num_pending_copies: int,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    hazards: dict[str, int],
    device_time_ns: int | None = None,
    tiers: tuple[TierStats, ...] = (),
    kernel_pool: dict[str, int] | None = None,
) -> EngineStats:
    """Build an `EngineStats` (reads only)."""
    num_loading = sum(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in scheduler.waiting)
    if host_tier is not None:
        device, host = host_tier.pool_stats()
    else:
        device, host = kv.pool_stats(), None
    return EngineStats(
        device=device,
        host=host,
        num_requests=num_requests,
        num_waiting=len(scheduler.waiting) - num_loading,
        num_loading=num_loading,
        num_running=len(scheduler.running),
        num_steps=scheduler.sched_step_seq,
        num_steps_in_flight=scheduler.num_unprocessed_steps,
        num_pending_loads=0 if host_tier is None else host_tier.num_pending_loads,
        num_pending_stores=0 if host_tier is None else host_tier.num_pending_stores,
        num_pending_copies=num_pending_copies,
        num_preemptions=scheduler.num_preemptions,
        num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens,
        hazards=hazards,
        device_time_ns=device_time_ns,
        prefix_cache=replace(kv.stats),
        host_metrics=None if host_tier is None else replace(host_tier.metrics),
        host_store_mode=None if host_tier is None else host_tier.store_mode,
        tiers=tiers,
        kernel_pool={} if kernel_pool is None else kernel_pool,
    )
