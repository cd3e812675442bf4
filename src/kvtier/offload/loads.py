"""LoadPlanner: host → device loads (lookup with pending-hit pins, pairing, completion, failure).

Owns the pending hits, the loads in flight and the claims on keys being loaded; changes no
request (it returns decisions: which requests finished loading, how a failed one rolls back).
A prefix that another request is loading (or has a pending hit on) is not loaded twice: the lookup
answers `wait_for_load` and the scheduler retries after that load completes, when the device cache
serves it. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.ids import BlockId, ReqId
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import IntegrityError
from kvtier.offload.context import HostContext
from kvtier.offload.lookup import HostHit, extend_device_hit
from kvtier.offload.types import Key, Transfer
from kvtier.sched.connector import LoadFailure, TierLookup
from kvtier.sched.request import Request


@dataclass(slots=True)
class _PendingHit:
    num_device_hit: int
    num_tokens: int
    blocks: HostHit  # per group: table position -> host block
    pinned: list[KVBlock]  # one lookup reference each
    keys: list[Key]


@dataclass(slots=True)
class _Load:
    transfer: Transfer
    req_id: ReqId
    num_device_hit: int
    num_tokens: int  # external tokens restored
    positions: list[int]  # table position of each pair
    host_blocks: list[KVBlock]  # one reference each, held until completion
    device_blocks: list[KVBlock]  # one device pin each
    keys: list[Key]
    reports: int = 0
    cancelled: bool = False


class LoadPlanner:
    """Loads of one host tier; `ctx` is what it shares with the store planner."""

    def __init__(self, ctx: HostContext) -> None:
        self.ctx = ctx
        self.specs = ctx.specs
        self.device_kv = ctx.device_kv
        self.host = ctx.host
        self.metrics = ctx.metrics
        self._pending: dict[str, _PendingHit] = {}
        self._loads: dict[int, _Load] = {}
        self._claims: dict[Key, str] = {}  # keys pending or loading -> the request claiming them
        # request -> (query tokens, hit tokens) of its last lookup, counted once it is admitted
        self._last_lookup: dict[str, tuple[int, int]] = {}

    def owns(self, transfer_id: int) -> bool:
        """True if `transfer_id` is a load in flight."""
        return transfer_id in self._loads

    @property
    def num_in_flight(self) -> int:
        return len(self._loads)

    def is_loading(self, request_id: ReqId) -> bool:
        """True while a load of the request is in flight (cancelled or not)."""
        return any(load.req_id == request_id for load in self._loads.values())

    def lookup(
        self, request: Request, num_device_hit_tokens: int, max_external_tokens: int | None = None
    ) -> TierLookup:
        """Tokens beyond `num_device_hit_tokens` the host tier can restore for a waiting request.

        Every group is restored to one aligned boundary or nothing (architecture.md §H6). The hit
        blocks are
        pinned until `plan_load` or the next lookup of this request; call again with
        `max_external_tokens` to accept fewer tokens (window groups need the exact boundary).
        """
        rid = request.request_id
        self._release_pending(rid)
        max_len = request.num_tokens - 1  # the last token is always recomputed
        if max_external_tokens is not None:
            max_len = min(max_len, num_device_hit_tokens + max_external_tokens)
        self._last_lookup.pop(rid, None)
        if max_len <= num_device_hit_tokens:
            return TierLookup(0)
        num_query = max_len - num_device_hit_tokens
        self._last_lookup[rid] = (num_query, 0)
        hits, length = extend_device_hit(
            self.ctx, request.block_hashes, num_device_hit_tokens, max_len
        )
        if length <= num_device_hit_tokens:
            return TierLookup(0)
        pinned: list[KVBlock] = []
        keys: list[Key] = []
        for g, blocks in enumerate(hits):
            for block in blocks.values():
                assert block.block_hash is not None
                key = (g, block.block_hash)
                if self._claims.get(key, rid) != rid:
                    self.metrics.num_load_waits += 1
                    del self._last_lookup[rid]  # it retries: that lookup will count
                    return TierLookup(0, wait_for_load=True)
                pinned.append(block)
                keys.append(key)
        self.host.pool.touch(pinned)
        for key in keys:
            self._claims[key] = rid
        self._pending[rid] = _PendingHit(
            num_device_hit_tokens, length - num_device_hit_tokens, hits, pinned, keys
        )
        self._last_lookup[rid] = (num_query, length - num_device_hit_tokens)
        return TierLookup(length - num_device_hit_tokens)

    def record_lookup(self, request_id: str) -> None:
        """Count the request's last lookup in the metrics (the one it was admitted with)."""
        counted = self._last_lookup.pop(request_id, None)
        if counted is not None:
            self.metrics.num_queries += 1
            self.metrics.num_query_tokens += counted[0]
            self.metrics.num_hit_tokens += counted[1]

    def _release_pending(self, rid: str) -> None:
        hit = self._pending.pop(rid, None)
        if hit is None:
            return
        for key in hit.keys:
            self._claims.pop(key, None)
        self.host.pool.free(list(reversed(hit.pinned)))

    # ---- loads ---------------------------------------------------------------------------------

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None:
        """Pair the pending hit's host blocks with the device blocks just allocated for them.

        Call after `device_kv.allocate_slots(..., num_external_computed_tokens=num_external_tokens,
        delay_cache_blocks=True)` succeeded (or with 0 to drop the pending hit). Host sources and
        device destinations stay pinned until the transfer completes or fails.
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
        tables = self.device_kv.get_blocks(rid)
        end = hit.num_device_hit + num_external_tokens
        groups: list[int] = []
        positions: list[int] = []
        host_blocks: list[KVBlock] = []
        device_blocks: list[KVBlock] = []
        unused: list[KVBlock] = []
        for g, blocks in enumerate(hit.blocks):
            bs = self.specs[g].block_size
            for pos in range(hit.num_device_hit // bs, end // bs):
                hb, db = blocks.get(pos), tables[g][pos]
                if hb is None:
                    continue
                if db.is_null:  # outside the device table's window: nothing to restore there
                    unused.append(hb)
                    continue
                groups.append(g)
                positions.append(pos)
                host_blocks.append(hb)
                device_blocks.append(db)
        self.host.pool.free(unused)
        self.device_kv.pin(device_blocks)
        transfer = Transfer(
            self.ctx.new_transfer_id(),
            rid,
            True,
            groups,
            [b.block_id for b in host_blocks],
            [b.block_id for b in device_blocks],
            sum(self.ctx.bytes_per_block[g] for g in groups),
        )
        keys = [(g, b.block_hash) for g, b in zip(groups, host_blocks) if b.block_hash is not None]
        for key in hit.keys:
            if key not in keys:
                self._claims.pop(key, None)
        self._loads[transfer.transfer_id] = _Load(
            transfer,
            rid,
            hit.num_device_hit,
            num_external_tokens,
            positions,
            host_blocks,
            device_blocks,
            keys,
        )
        self.metrics.num_pending_loads = len(self._loads)
        return transfer

    def cancel_load(self, request_id: str) -> None:
        """The request is finished or aborted: drop its pending hit; an in-flight load keeps its
        pins until the copy completes or fails (it still writes the destination blocks)."""
        self._release_pending(request_id)
        self._last_lookup.pop(request_id, None)
        for load in self._loads.values():
            if load.req_id == request_id:
                load.cancelled = True

    def _end_load(self, load: _Load) -> None:
        del self._loads[load.transfer.transfer_id]
        for key in load.keys:
            if self._claims.get(key) == load.req_id:
                del self._claims[key]
        self.host.pool.free(list(reversed(load.host_blocks)))
        self.device_kv.unpin(load.device_blocks)
        self.metrics.num_pending_loads = len(self._loads)

    def complete(self, transfer_id: int) -> str | None:
        """One worker reported the load done; returns the request id once it is loaded."""
        load = self._loads.get(transfer_id)
        if load is None:
            return None
        load.reports += 1
        if load.reports < self.ctx.world_size:
            return None
        self._end_load(load)
        if load.cancelled:
            return None
        self.metrics.num_loaded_blocks += load.transfer.num_blocks
        self.metrics.num_loaded_bytes += load.transfer.num_bytes
        return load.req_id

    def fail(
        self, transfer_id: int, failed_device_block_ids: Iterable[BlockId] | None
    ) -> tuple[LoadFailure | None, list[Key]]:
        """A load failed: (how its request rolls back, None if it was cancelled; the host keys
        whose copies are suspect, for the tier to evict)."""
        load = self._loads[transfer_id]
        t = load.transfer
        bad = set(t.dst_block_ids if failed_device_block_ids is None else failed_device_block_ids)
        # The host copies of the failed pairs are suspect: evict them, or every later request
        # with this prefix would load them again, fail and recompute.
        suspect = [
            (g, hb.block_hash)
            for g, hb, d in zip(t.group_ids, load.host_blocks, t.dst_block_ids)
            if d in bad and hb.block_hash is not None
        ]
        self._end_load(load)
        self.metrics.num_failed_loads += 1
        if load.cancelled:
            return None, suspect
        end = load.num_device_hit + load.num_tokens
        good = end
        for g, pos, d in zip(t.group_ids, load.positions, t.dst_block_ids):
            if d in bad:
                good = min(good, pos * self.specs[g].block_size)
        align = self.ctx.coordinator.alignment
        good = max(good // align * align, load.num_device_hit)
        evict = [
            d
            for g, pos, d in zip(t.group_ids, load.positions, t.dst_block_ids)
            if self.ctx.block_end(g, pos) > good
        ]
        must_reallocate = good < end and not all(self.ctx.chained)
        num_good = 0 if must_reallocate else good
        return LoadFailure(t.req_id, num_good, evict, must_reallocate), suspect

    # ---- views ---------------------------------------------------------------------------------

    def pending_host_blocks(self) -> list[KVBlock]:
        return [b for h in self._pending.values() for b in h.pinned]

    def host_blocks(self) -> list[KVBlock]:
        return [b for ld in self._loads.values() for b in ld.host_blocks]

    def device_blocks(self) -> list[KVBlock]:
        return [b for ld in self._loads.values() for b in ld.device_blocks]

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._pending)

    def check_integrity(self) -> None:
        """Check claims and the pending-load count; raises `IntegrityError` naming what drifted."""
        claimed = {k for h in self._pending.values() for k in h.keys}
        claimed |= {k for ld in self._loads.values() for k in ld.keys}
        if not set(self._claims) <= claimed:
            raise IntegrityError("load claim without a pending hit or load")
        if self.metrics.num_pending_loads != len(self._loads):
            raise IntegrityError(
                f"pending-load count drifted: {self.metrics.num_pending_loads} counted, "
                f"{len(self._loads)} loads"
            )
