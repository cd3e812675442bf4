"""HostTier: the scheduler half of the host-memory KV tier (lookup, loads, stores, completions).

Torch-free. The scheduler calls, per step:
  lookup(req, device_hit)        waiting request: tokens the host tier adds beyond the device hit
  plan_load(req, n)              after device.allocate_slots(..., num_external_computed_tokens=n,
                                 delay_cache_blocks=True) succeeded; the request then waits
  plan_stores(running)           once per step, after updates: stores of settled blocks, re-stores
  complete(ids) / fail(id)       transfers the runner reported done / failed
  finish_request / preempt_request   before the request's device blocks are freed (flushes stores)
`device_pins()` feeds `KVCacheManager.check_integrity(num_pinned=...)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.kv.block import BlockId, KVBlock
from kvtier.kv.coordinator import KVCacheCoordinator
from kvtier.kv.manager import KVCacheManager
from kvtier.kv.specs import FullAttention, Mamba
from kvtier.offload.host_cache import HostCache
from kvtier.offload.stores import StorePlanner
from kvtier.offload.types import HostLookup, HostTierMetrics, Key, LoadFailure, Transfer
from kvtier.sched.request import Request, RequestStatus


@dataclass(slots=True)
class _PendingHit:
    num_device_hit: int
    num_tokens: int
    blocks: list[list[KVBlock]]  # host hit per group, positions from 0
    pinned: list[KVBlock]  # one lookup reference each
    keys: list[Key]


@dataclass(slots=True)
class _Load:
    transfer: Transfer
    request: Request
    num_device_hit: int
    num_tokens: int  # external tokens restored
    positions: list[int]  # table position of each pair
    host_blocks: list[KVBlock]  # one reference each, held until completion
    device_blocks: list[KVBlock]  # one device pin each
    keys: list[Key]
    reports: int = 0
    cancelled: bool = False


@dataclass(slots=True)
class _LoadClaims:
    """Keys being loaded (or about to be: pending hits) -> the request claiming them."""

    owner: dict[Key, str] = field(default_factory=dict)


class HostTier:
    """Host tier over one host `BlockPool` (same groups as the device, keyed by (group, hash)).

    `store_mode`: "eager" stores a request's full blocks once settled; "lazy" stores hashed
    blocks that reach the device LRU head. `world_size`: a transfer completes when every worker
    reported it. `max_restores_per_step` caps re-stores after eviction (no thrash).
    """

    def __init__(
        self,
        device: KVCacheManager,
        num_host_blocks: int,
        *,
        store_mode: str = "eager",
        bytes_per_block: Sequence[int] | int = 0,
        world_size: int = 1,
        max_restores_per_step: int = 8,
        lazy_scan_blocks: int = 64,
        enable_kv_events: bool = False,
    ) -> None:
        if store_mode not in ("eager", "lazy"):
            raise ValueError(f"store mode must be 'eager' or 'lazy', got {store_mode!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be ≥ 1, got {world_size}")
        self.device = device
        self.specs = device.specs
        self.store_mode = store_mode
        self.world_size = world_size
        per_group = (
            [bytes_per_block] * len(self.specs)
            if isinstance(bytes_per_block, int)
            else list(bytes_per_block)
        )
        if len(per_group) != len(self.specs):
            raise ValueError("bytes_per_block needs one value per KV-cache group")
        self.bytes_per_block = per_group
        self.metrics = HostTierMetrics()
        self._store_keys: dict[Key, int] = {}  # keys whose store is in flight -> transfer id
        self.host = HostCache(
            num_host_blocks, lambda k: k in self._store_keys, enable_kv_events=enable_kv_events
        )
        self.coordinator = KVCacheCoordinator(self.specs, self.host.pool)
        # Mamba state blocks have no external-load destination in the device table yet.
        self.enabled = not any(isinstance(s, Mamba) for s in self.specs)
        self.chained = [isinstance(s, FullAttention) for s in self.specs]
        self._next_id = 0
        self._pending: dict[str, _PendingHit] = {}
        self._loads: dict[int, _Load] = {}
        self._claims = _LoadClaims()
        self.stores = StorePlanner(self, max_restores_per_step, lazy_scan_blocks)

    def new_transfer_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # ---- lookup --------------------------------------------------------------------------------

    def lookup(
        self, request: Request, num_device_hit_tokens: int, max_external_tokens: int | None = None
    ) -> HostLookup:
        """Tokens beyond `num_device_hit_tokens` the host tier can restore for a waiting request.

        Every group is restored to one aligned boundary or nothing (H6). The hit blocks are
        pinned until `plan_load` or the next lookup of this request; call again with
        `max_external_tokens` to accept fewer tokens (window groups need the exact boundary).
        """
        rid = request.request_id
        self._release_pending(rid)
        max_len = request.num_tokens - 1  # the last token is always recomputed
        if max_external_tokens is not None:
            max_len = min(max_len, num_device_hit_tokens + max_external_tokens)
        if not self.enabled or max_len <= num_device_hit_tokens:
            return HostLookup(0)
        self.metrics.num_queries += 1
        self.metrics.num_query_tokens += max_len - num_device_hit_tokens
        hits, length = self.coordinator.find_longest_cache_hit(request.block_hashes, max_len)
        if length <= num_device_hit_tokens:
            return HostLookup(0)
        pinned: list[KVBlock] = []
        keys: list[Key] = []
        for g, blocks in enumerate(hits):
            bs = self.specs[g].block_size
            for pos in range(num_device_hit_tokens // bs, length // bs):
                block = blocks[pos]
                if block.is_null:
                    continue
                assert block.block_hash is not None
                key = (g, block.block_hash)
                if self._claims.owner.get(key, rid) != rid:
                    self.metrics.num_load_waits += 1
                    return HostLookup(0, wait_for_load=True)
                pinned.append(block)
                keys.append(key)
        self.host.pool.touch(pinned)
        for key in keys:
            self._claims.owner[key] = rid
        self._pending[rid] = _PendingHit(
            num_device_hit_tokens, length - num_device_hit_tokens, hits, pinned, keys
        )
        self.metrics.num_hit_tokens += length - num_device_hit_tokens
        return HostLookup(length - num_device_hit_tokens)

    def _release_pending(self, rid: str) -> None:
        hit = self._pending.pop(rid, None)
        if hit is None:
            return
        for key in hit.keys:
            self._claims.owner.pop(key, None)
        self.host.pool.free(list(reversed(hit.pinned)))

    # ---- loads ---------------------------------------------------------------------------------

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None:
        """Pair the pending hit's host blocks with the device blocks just allocated for them.

        Call after `device.allocate_slots(..., num_external_computed_tokens=num_external_tokens,
        delay_cache_blocks=True)` succeeded (or with 0 to drop the pending hit). Host sources and
        device destinations stay pinned until the transfer completes or fails; the request is set
        to WAITING_FOR_REMOTE_KVS until then.
        """
        rid = request.request_id
        if num_external_tokens == 0:
            self._release_pending(rid)
            return None
        hit = self._pending.get(rid)
        if hit is None or hit.num_tokens != num_external_tokens:
            offered = 0 if hit is None else hit.num_tokens
            raise ValueError(
                f"{rid}: plan_load({num_external_tokens}) but the last lookup offered {offered}; "
                "look up again with max_external_tokens to accept fewer"
            )
        del self._pending[rid]
        tables = self.device.get_blocks(rid)
        end = hit.num_device_hit + num_external_tokens
        groups: list[int] = []
        positions: list[int] = []
        host_blocks: list[KVBlock] = []
        device_blocks: list[KVBlock] = []
        unused: list[KVBlock] = []
        for g, blocks in enumerate(hit.blocks):
            bs = self.specs[g].block_size
            for pos in range(hit.num_device_hit // bs, end // bs):
                hb, db = blocks[pos], tables[g][pos]
                if hb.is_null:
                    continue
                if db.is_null:  # outside the device table's window: nothing to restore there
                    unused.append(hb)
                    continue
                groups.append(g)
                positions.append(pos)
                host_blocks.append(hb)
                device_blocks.append(db)
        self.host.pool.free(unused)
        self.device.pool.touch(device_blocks)
        transfer = Transfer(
            self.new_transfer_id(),
            rid,
            True,
            groups,
            [b.block_id for b in host_blocks],
            [b.block_id for b in device_blocks],
            sum(self.bytes_per_block[g] for g in groups),
        )
        keys = [(g, b.block_hash) for g, b in zip(groups, host_blocks) if b.block_hash is not None]
        for key in hit.keys:
            if key not in keys:
                self._claims.owner.pop(key, None)
        self._loads[transfer.transfer_id] = _Load(
            transfer,
            request,
            hit.num_device_hit,
            num_external_tokens,
            positions,
            host_blocks,
            device_blocks,
            keys,
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.metrics.num_pending_loads = len(self._loads)
        return transfer

    def cancel_load(self, request_id: str) -> None:
        """The request is finished or aborted: drop its pending hit; an in-flight load keeps its
        pins until the copy completes or fails (it still writes the destination blocks)."""
        self._release_pending(request_id)
        for load in self._loads.values():
            if load.request.request_id == request_id:
                load.cancelled = True

    def _end_load(self, load: _Load) -> None:
        del self._loads[load.transfer.transfer_id]
        for key in load.keys:
            if self._claims.owner.get(key) == load.request.request_id:
                del self._claims.owner[key]
        self.host.pool.free(list(reversed(load.host_blocks)))
        self.device.pool.free(load.device_blocks)
        self.metrics.num_pending_loads = len(self._loads)

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

    def plan_stores(self, requests: Iterable[Request]) -> list[Transfer]:
        """Once per step: stores for `requests` (eager; the running ones), or of blocks near the
        device LRU head (lazy), then re-stores of evicted blocks, rate-limited."""
        return self.stores.plan(requests)

    @property
    def has_pending_stores(self) -> bool:
        return self.stores.num_in_flight > 0

    # ---- completions ---------------------------------------------------------------------------

    def complete(self, transfer_ids: Iterable[int]) -> list[str]:
        """Transfers one worker reported done (any order). Returns the ids of requests whose
        load finished: they are WAITING again, with their KV on the device; the scheduler
        publishes their blocks (`device.cache_blocks`) and schedules them."""
        loaded: list[str] = []
        for tid in transfer_ids:
            load = self._loads.get(tid)
            if load is None:
                self.stores.complete(tid)
                continue
            load.reports += 1
            if load.reports < self.world_size:
                continue
            self._end_load(load)
            if load.cancelled:
                continue
            self.metrics.num_loaded_blocks += load.transfer.num_blocks
            self.metrics.num_loaded_bytes += load.transfer.num_bytes
            load.request.status = RequestStatus.WAITING
            loaded.append(load.request.request_id)
        return loaded

    def fail(
        self, transfer_id: int, failed_device_block_ids: Iterable[BlockId] | None = None
    ) -> LoadFailure | None:
        """A transfer failed (None: every block). A load rolls its request back to the last good
        block (recomputed later, same output); a store is dropped and re-planned."""
        load = self._loads.get(transfer_id)
        if load is None:
            self.stores.fail(transfer_id)
            return None
        self._end_load(load)
        self.metrics.num_failed_loads += 1
        if load.cancelled:
            return None
        t = load.transfer
        bad = set(t.dst_block_ids if failed_device_block_ids is None else failed_device_block_ids)
        end = load.num_device_hit + load.num_tokens
        good = end
        for g, pos, d in zip(t.group_ids, load.positions, t.dst_block_ids):
            if d in bad:
                good = min(good, pos * self.specs[g].block_size)
        align = self.device.coordinator.alignment
        good = max(good // align * align, load.num_device_hit)
        evict = [
            d
            for g, pos, d in zip(t.group_ids, load.positions, t.dst_block_ids)
            if (pos + 1) * self.specs[g].block_size > good
        ]
        must_reallocate = good < end and not all(self.chained)
        request = load.request
        request.num_computed_tokens = 0 if must_reallocate else good
        request.status = RequestStatus.WAITING
        return LoadFailure(t.req_id, request.num_computed_tokens, evict, must_reallocate)

    # ---- reset, pins, integrity ----------------------------------------------------------------

    def reset_cache(self) -> bool:
        """Forget the host cache. With transfers in flight: abandon them (their completions
        release pins without publishing) and return False; call again once they completed."""
        if self._loads or self.stores.num_in_flight or self._pending:
            self.stores.abandon_all()
            return False
        self.stores.forget_all()
        return self.host.reset()

    def device_pins(self) -> dict[BlockId, int]:
        """Device block id -> references the tier holds (load destinations, store sources)."""
        pins: dict[BlockId, int] = {}
        blocks = [b for ld in self._loads.values() for b in ld.device_blocks]
        blocks += self.stores.pinned_device_blocks()
        for b in blocks:
            pins[b.block_id] = pins.get(b.block_id, 0) + 1
        return pins

    def check_integrity(self) -> None:
        """Assert every host reference has exactly one holder and every device pin is backed."""
        self.host.check_integrity()
        holders: dict[BlockId, int] = {}
        held = [b for h in self._pending.values() for b in h.pinned]
        held += [b for ld in self._loads.values() for b in ld.host_blocks]
        held += self.stores.host_blocks()
        for b in held:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.host.pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), (
                f"host {b!r}: {holders.get(b.block_id, 0)} holders"
            )
        for block_id, n in self.device_pins().items():
            assert self.device.pool.blocks[block_id].ref_cnt >= n, (
                f"device block {block_id} unpinned"
            )
        claimed = {k for h in self._pending.values() for k in h.keys}
        claimed |= {k for ld in self._loads.values() for k in ld.keys}
        assert set(self._claims.owner) <= claimed, "load claim without a pending hit or load"
        assert self.metrics.num_pending_loads == len(self._loads)
        self.stores.check_integrity()
