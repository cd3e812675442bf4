"""HostTier: the scheduler half of the host-memory KV tier, the first `sched.connector.KVTier`.

Owns the host cache, the load planner (`loads.py`) and the store planner (`stores.py`), which share
`HostContext` and never see each other or the tier; it routes between them (a failed load's
suspect keys are evicted here, evictions reach the store planner here). It returns decisions and
changes no request. The scheduler calls, per step:
  lookup(req, device_hit)        waiting request: tokens the host tier adds beyond the device hit
  plan_load(req, n)              after device_kv.allocate_slots(..., num_external_computed_tokens=n,
                                 delay_cache_blocks=True) succeeded; the request then waits
  plan_stores(running)           once per step, after updates: stores of settled blocks, re-stores
  complete(ids) / fail(id)       transfers the runner reported done / failed
  finish_request / preempt_request   before the request's device blocks are freed (flushes stores)
`device_pins()` feeds `KVCacheManager.check_integrity(num_pinned=...)`. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvtier.ids import BlockHash, BlockId, ReqId
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import IntegrityError
from kvtier.kv.events import KVEvent
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.specs import KVSpec
from kvtier.kv.stats import PoolStats
from kvtier.offload.context import HostContext
from kvtier.offload.host_cache import HostCache
from kvtier.offload.loads import LoadPlanner
from kvtier.offload.store_records import Published, StoreProgress
from kvtier.offload.stores import StorePlanner
from kvtier.offload.types import Key, Transfer
from kvtier.sched.connector import LoadFailure, TierLookup
from kvtier.sched.request import Request


def lazy_scan_blocks_for(specs: Sequence[KVSpec], max_num_batched_tokens: int) -> int:
    """Blocks the lazy store mode keeps free-or-stored at the device LRU head: twice what one
    step can allocate (a step of B tokens takes at most cdiv(B, bs) + 1 blocks per group), as
    vLLM's lazy target is twice a step's worth."""
    return 2 * sum(-(-max_num_batched_tokens // s.block_size) + 1 for s in specs)


class HostTier:
    """Host tier over one host `BlockPool` (same groups as the device, keyed by (group, hash)).

    `store_mode`: "eager" stores a request's full blocks once settled; "lazy" stores hashed
    blocks that reach the device LRU head (the first `lazy_scan_blocks` blocks there, see
    `lazy_scan_blocks_for`, are kept free or stored). `world_size`: a transfer completes when every worker
    reported it. `max_restores_per_step` caps re-stores after eviction (no thrash).
    `record_published`: keep what eager stores publish for `take_published` (the tier chain
    demotes it to the disk and remote tiers, architecture.md §Chain).
    `store_from_settled=False` plans stores from the optimistic count (undelivered outputs excluded,
    steps still executing included) instead: protection `settled` off, which reproduces the store
    read-after-write of architecture.md §H1 without the event.
    """

    def __init__(
        self,
        device_kv: KVCacheManager,
        num_host_blocks: int,
        *,
        store_mode: str = "eager",
        bytes_per_block: Sequence[int] | int = 0,
        world_size: int = 1,
        max_restores_per_step: int = 8,
        lazy_scan_blocks: int = 64,
        store_from_settled: bool = True,
        enable_kv_events: bool = False,
        record_published: bool = False,
    ) -> None:
        if store_mode not in ("eager", "lazy"):
            raise ValueError(f"store mode must be 'eager' or 'lazy', got {store_mode!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be ≥ 1, got {world_size}")
        specs = device_kv.specs
        per_group = (
            [bytes_per_block] * len(specs)
            if isinstance(bytes_per_block, int)
            else list(bytes_per_block)
        )
        if len(per_group) != len(specs):
            raise ValueError("bytes_per_block needs one value per KV-cache group")
        host = HostCache(
            num_host_blocks,
            lambda key: self.stores.is_storing(key),
            enable_kv_events=enable_kv_events,
        )
        ctx = HostContext(device_kv, host, per_group, world_size)
        self.device_kv = device_kv  # the device tier's KV manager (tables, pins)
        self.host = host
        self.specs = ctx.specs
        self.coordinator = ctx.coordinator
        self.metrics = ctx.metrics
        self.store_mode = store_mode
        self.store_from_settled = store_from_settled
        self.loads = LoadPlanner(ctx)
        self.stores = StorePlanner(
            ctx,
            store_mode=store_mode,
            store_from_settled=store_from_settled,
            max_restores_per_step=max_restores_per_step,
            lazy_scan_blocks=lazy_scan_blocks,
            record_published=record_published,
        )

    # ---- lookup --------------------------------------------------------------------------------

    def lookup(
        self, request: Request, num_device_hit_tokens: int, max_external_tokens: int | None = None
    ) -> TierLookup:
        """Tokens beyond `num_device_hit_tokens` the host tier can restore for a waiting request.

        Every group is restored to one aligned boundary or nothing (architecture.md §H6). The hit
        blocks are pinned until `plan_load` or the next lookup of this request; call again with
        `max_external_tokens` to accept fewer tokens (window groups need the exact boundary).
        `wait_for_load`: another request is loading this prefix; retry after it completes.
        """
        return self.loads.lookup(request, num_device_hit_tokens, max_external_tokens)

    def record_lookup(self, request: Request) -> None:
        """The request was admitted, or its load planned, with its last lookup: count that
        lookup in `metrics` (once per admission, however often it was looked up)."""
        self.loads.record_lookup(request.request_id)

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None:
        """Pair the pending hit's host blocks with the device blocks just allocated for them.

        Call after `device_kv.allocate_slots(..., num_external_computed_tokens=
        num_external_tokens, delay_cache_blocks=True)` succeeded (or with 0 to drop the pending
        hit, e.g. when the allocation failed). Host sources and device destinations stay pinned
        until the transfer completes or fails; the scheduler keeps the request waiting until
        `complete` names it.
        """
        return self.loads.plan_load(request, num_external_tokens)

    def cancel_load(self, request_id: ReqId) -> None:
        """Drop the request's pending hit; an in-flight load keeps its pins until the copy
        completes or fails (it still writes the destination blocks), then reports nothing."""
        self.loads.cancel_load(request_id)

    # ---- requests ------------------------------------------------------------------------------

    def finish_request(self, request: Request) -> list[Transfer]:
        """The request finished or was aborted; call before freeing its device blocks. Returns
        the final stores of its settled, unstored blocks (they keep their device pins)."""
        self.cancel_load(request.request_id)
        return self.stores.flush(request, finished=True)

    def preempt_request(self, request: Request) -> list[Transfer]:
        """The request is preempted; call before freeing its device blocks. Stores what is
        settled (it will look it up when it comes back); its cursor is kept."""
        return self.stores.flush(request, finished=False)

    def store_before_prune(self, request: Request) -> list[Transfer]:
        """The request's windows are about to drop blocks from its device table (a settled
        prefill chunk longer than the window prunes in the same update): stores of its settled,
        unstored blocks, planned now so window blocks reach the host tier too (they keep device
        pins until stored). Call before pruning."""
        return self.stores.plan_before_prune(request)

    def plan_stores(self, requests: Iterable[Request]) -> list[Transfer]:
        """Once per step: stores for `requests` (eager; the running ones), or of blocks near the
        device LRU head (lazy), then re-stores of evicted blocks, rate-limited."""
        return self.stores.plan(requests)

    @property
    def has_pending_stores(self) -> bool:
        return self.stores.num_in_flight > 0

    @property
    def has_pending_transfers(self) -> bool:
        """True while a load or a store is in flight: its completion must still be polled to
        release its pins (a cancelled load's included: it still writes its destinations)."""
        return self.loads.num_in_flight > 0 or self.stores.num_in_flight > 0

    @property
    def num_pending_loads(self) -> int:
        return self.loads.num_in_flight

    @property
    def num_pending_stores(self) -> int:
        return self.stores.num_in_flight

    def is_loading(self, request_id: ReqId) -> bool:
        """True while a load planned for the request is in flight (cancelled or not)."""
        return self.loads.is_loading(request_id)

    def store_progress(self, request_id: ReqId) -> StoreProgress | None:
        """How far the eager store of a request got (None: the tier keeps no state for it)."""
        return self.stores.progress(request_id)

    # ---- completions ---------------------------------------------------------------------------

    def complete(self, transfer_ids: Iterable[int]) -> list[ReqId]:
        """Transfers one worker reported done (any order; repeats of ended ids are ignored).
        Returns the ids of requests whose load finished, their KV now on the device: the
        scheduler publishes their blocks (`KVCacheManager.cache_blocks`) and lets them run."""
        loaded: list[ReqId] = []
        for tid in transfer_ids:
            if self.loads.owns(tid):
                rid = self.loads.complete(tid)
                if rid is not None:
                    loaded.append(rid)
            else:
                self.stores.complete(tid)
        return loaded

    def fail(
        self, transfer_id: int, failed_device_block_ids: Iterable[BlockId] | None = None
    ) -> LoadFailure | None:
        """A transfer failed (`failed_device_block_ids` None: every block). For a load, how its
        request rolls back to the last good block (recomputed later, same output: what to evict,
        whether to reallocate); its suspect host copies are evicted. A failed store is dropped
        and re-stored like an eviction (rate-limited); returns None then."""
        if not self.loads.owns(transfer_id):
            self.stores.fail(transfer_id)
            return None
        failure, suspect = self.loads.fail(transfer_id, failed_device_block_ids)
        self.evict(suspect)
        return failure

    def evict(self, keys: Iterable[Key]) -> int:
        """Drop host entries known to be bad (e.g. a load from them failed; mutates). Requests
        whose chain held them re-store them from their device copies (rate-limited). Returns
        the number of entries dropped."""
        dropped = 0
        for key in keys:
            if self.host.evict(key):
                dropped += 1
                self.stores.on_evicted(key, notify=True)
        return dropped

    # ---- the tiers below the host (architecture.md §Chain) --------------------------------------

    def take_published(self) -> list[Published]:
        """Blocks eager stores published since the last call (empty without `record_published`;
        mutates). Read their bytes before the next host allocation can reuse them."""
        return self.stores.take_published()

    def holds(self, key: Key) -> bool:
        """True if the host caches `key` or a store of it is in flight."""
        return self.host.contains(key) or self.stores.is_storing(key)

    def allocate_staging(self, n: int) -> list[KVBlock]:
        """Up to `n` host blocks (ref 1 each; fewer when fewer are allocatable) to write blocks of
        a lower tier into, evicting LRU entries as a store does (their holders re-store them).
        Publish them with `publish_staged` or give them back with `release_staging`."""
        n = min(n, self.host.num_free)
        if n <= 0:
            return []
        blocks, evicted = self.host.allocate(n)
        self.metrics.num_evicted_blocks += len(evicted)
        self.metrics.num_orphans_demoted = self.host.num_orphans_demoted
        for key in evicted:
            self.stores.on_evicted(key, notify=True)
        return blocks

    def publish_staged(
        self,
        group_id: int,
        blocks: Sequence[KVBlock],
        hashes: Sequence[BlockHash],
        parents: Sequence[BlockHash | None],
        origins: Sequence[int],
        token_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Staging blocks whose bytes are written, head → tail of their chain, become host hits;
        their staging references are dropped (mutates the host cache). `origins`: the lower
        tier each block came from, until `take_origin` or its eviction. `token_ids`: per block,
        its tokens (for the events)."""
        bs = self.specs[group_id].block_size
        self.host.publish(group_id, blocks, hashes, parents, bs, origins, token_ids)

    @property
    def emits_events(self) -> bool:
        """Whether the host pool records KV events (`take_events`)."""
        return self.host.pool.enable_kv_events

    def take_events(self) -> list[KVEvent]:
        """The host pool's KV events since the last call (mutates)."""
        return self.host.pool.take_events()

    def take_origin(self, key: Key) -> int | None:
        """The lower tier a staged host entry came from, the first time it is asked (the hit
        that loads it first is that tier's); None for an entry the host stored itself."""
        return self.host.take_origin(key)

    def release_staging(self, blocks: Sequence[KVBlock]) -> None:
        """Give back staging blocks that were not published."""
        self.host.pool.free(blocks)

    # ---- reset, pins, integrity ----------------------------------------------------------------

    def reset_cache(self) -> bool:
        """Forget the host cache. With transfers in flight: abandon them (their completions
        release pins without publishing) and return False; call again once they completed."""
        if self.loads.busy or self.stores.num_in_flight:
            self.stores.abandon_all()
            return False
        self.stores.forget_all()
        return self.host.reset()

    def pool_stats(self) -> tuple[PoolStats, PoolStats]:
        """Snapshots of the device and host pools with the references this tier's copies hold
        (load pins: device destinations, host sources and pending hits; store pins: device
        sources, host destinations). Changes nothing."""
        device = replace(
            self.device_kv.pool_stats(),
            num_load_pins=len(self.loads.device_blocks()),
            num_store_pins=len(self.stores.pinned_device_blocks()),
        )
        host = replace(
            self.host.pool.stats(),
            num_load_pins=len(self.loads.pending_host_blocks()) + len(self.loads.host_blocks()),
            num_store_pins=len(self.stores.host_blocks()),
        )
        return device, host

    def device_pins(self) -> dict[BlockId, int]:
        """Device block id -> references the tier holds (load destinations, store sources)."""
        pins: dict[BlockId, int] = {}
        for b in self._pinned_device_blocks():
            pins[b.block_id] = pins.get(b.block_id, 0) + 1
        return pins

    def _pinned_device_blocks(self) -> list[KVBlock]:
        return self.loads.device_blocks() + self.stores.pinned_device_blocks()

    def check_integrity(self) -> None:
        """Check that every host reference has exactly one holder and every device pin is backed;
        raises `IntegrityError` naming the first broken one."""
        self.host.check_integrity()
        holders: dict[BlockId, int] = {}
        held = self.loads.pending_host_blocks() + self.loads.host_blocks()
        held += self.stores.host_blocks()
        for b in held:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.host.pool.blocks[1:]:
            if b.ref_cnt != (expected := holders.get(b.block_id, 0)):
                raise IntegrityError(f"host {b!r}: {expected} holders")
        pins = self.device_pins()
        for b in self._pinned_device_blocks():
            if b.ref_cnt < pins[b.block_id]:
                raise IntegrityError(f"device {b!r} unpinned: {pins[b.block_id]} pins")
        self.loads.check_integrity()
        self.stores.check_integrity()
