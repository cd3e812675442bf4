"""StorePlanner: device → host stores from settled counts, re-store after eviction, completion.

Design choices (architecture.md §Stores and §Eviction; how they differ from vLLM: §History):
- stores are planned from the *settled* count (computed − in flight): every block planned is
  already final on the device, whatever the copy stream (no dependence on the compute event);
- each request keeps an *absolute* per-group cursor: positions below it were visited (stored,
  already cached, or null); a cursor only moves past positions actually planned or skipped;
- when the host evicts an entry, exactly the requests that stored it learn which position they
  lost (hash → requests map) and re-store it while their device copy still carries that hash,
  at most `max_restores_per_step` per step; an eviction caused by a re-store tells every chain
  but the re-storing one, each request re-stores a position at most once, and no plan evicts
  its own chain's earlier blocks to extend it (no thrash);
- blocks not planned because no host block is allocatable are counted, not silently dropped;
- finishing or preempting a request flushes its settled blocks at once.
Owns every store record, per-request store state and the keys being stored; changes no request.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import IntegrityError
from kvtier.offload.context import HostContext
from kvtier.offload.store_records import (
    Candidate,
    Published,
    ReqState,
    StoreProgress,
    StoreRecord,
)
from kvtier.offload.types import Key, Transfer
from kvtier.sched.request import Request


class StorePlanner:
    """Stores of one host tier; `ctx` is what it shares with the load planner.

    `store_mode` "eager" stores running requests' settled blocks, "lazy" the hashed blocks near
    the device LRU head; `store_from_settled=False` plans from the optimistic count instead.
    `record_published`: keep a `Published` record of every block a request's store publishes
    (taken by `take_published`; the tier chain demotes them below the host).
    """

    def __init__(
        self,
        ctx: HostContext,
        *,
        store_mode: str,
        store_from_settled: bool,
        max_restores_per_step: int,
        lazy_scan_blocks: int,
        record_published: bool = False,
    ) -> None:
        self.ctx = ctx
        self.record_published = record_published
        self._published: list[Published] = []
        self.store_mode = store_mode
        self.store_from_settled = store_from_settled
        self.max_restores_per_step = max_restores_per_step
        self.lazy_scan_blocks = lazy_scan_blocks
        self._states: dict[str, ReqState] = {}
        self._stores: dict[int, StoreRecord] = {}
        self._holders: dict[Key, set[str]] = {}  # key -> requests whose chain includes it
        self._store_keys: dict[Key, int] = {}  # keys whose store is in flight -> transfer id

    @property
    def num_in_flight(self) -> int:
        return len(self._stores)

    def is_storing(self, key: Key) -> bool:
        """True while a store of `key` is in flight."""
        return key in self._store_keys

    def progress(self, request_id: str) -> StoreProgress | None:
        st = self._states.get(request_id)
        if st is None:
            return None
        return StoreProgress(tuple(st.cursor), frozenset(st.lost), len(st.transfers), st.finished)

    # ---- planning ------------------------------------------------------------------------------

    def plan(self, requests: Iterable[Request]) -> list[Transfer]:
        out: list[Transfer] = []
        out += self._plan_restores()  # losses of earlier steps first: heads before new tails
        if self.store_mode == "lazy":
            out += self._plan_lazy()
        else:
            for request in requests:
                st = self._state(request)
                if not st.finished:
                    out += self._plan_request(st)
        return out

    def plan_before_prune(self, request: Request) -> list[Transfer]:
        """Eager mode: stores of the request's settled, unstored blocks now, before its windows
        drop them from the device table (lazy mode stores them near the device LRU head)."""
        if self.store_mode == "lazy":
            return []
        st = self._state(request)
        return [] if st.finished else self._plan_request(st)

    def flush(self, request: Request, finished: bool) -> list[Transfer]:
        st = self._states.get(request.request_id)
        if st is None or self.store_mode == "lazy":
            return []
        out = [] if st.finished else self._plan_request(st)
        st.lost.clear()  # the device copies are about to be released
        if finished:
            st.finished = True
            self._maybe_drop(st)
        return out

    def _state(self, request: Request) -> ReqState:
        st = self._states.get(request.request_id)
        if st is None:
            st = self._states[request.request_id] = ReqState(request, [0] * len(self.ctx.specs))
        st.request = request
        return st

    def _plan_request(self, st: ReqState) -> list[Transfer]:
        ctx, req = self.ctx, st.request
        tables = ctx.device_kv.get_blocks(req.request_id)
        views = ctx.coordinator.group_hashes(req.block_hashes)
        if self.store_from_settled:  # stale records count too: never ahead of the device
            settled = max(0, req.num_computed_tokens - req.ledger.num_in_flight_tokens)
            records = req.ledger.records
            if records and records[0].step_seq <= req.admit_seq:
                # Its prefix hits count as settled at once, but another request's step up to the
                # admission step may still be writing them (blocks are published at schedule
                # time): nothing is final before the admission step is processed.
                settled = 0
            for r in records:  # a step launched with drafts unverified may write lower
                if r.lowest_write is not None and r.lowest_write < settled:
                    settled = r.lowest_write
        else:  # optimistic: includes steps still executing (architecture.md §H1 without the event)
            settled = max(0, req.num_computed_tokens - req.num_output_placeholders)
        cands: list[Candidate] = []
        stop: list[int] = []  # per group: where the scan stopped
        for g, spec in enumerate(ctx.specs):
            bs, table, view = spec.block_size, tables[g], views[g]
            pos, end = st.cursor[g], min(settled // bs, len(view), len(table))
            while pos < end:
                db, h = table[pos], view[pos]
                if not db.is_null:
                    if db.block_hash != h:
                        break  # not published on the device yet: retry next step
                    key = (g, h)
                    if key in self._store_keys or ctx.host.contains(key):
                        ctx.metrics.num_deduped_blocks += 1
                        self._hold(st, key, pos)
                    else:
                        parent = view[pos - 1] if ctx.chained[g] and pos > 0 else None
                        cands.append(Candidate(g, pos, db, key, parent))
                pos += 1
            stop.append(pos)
        cands.sort(key=lambda c: (ctx.block_end(c.group_id, c.position), c.group_id))
        accepted = self._limit(st, cands, count_skipped=True)
        for g, pos in enumerate(stop):  # the cursor stops at the first candidate not planned
            rejected = [c.position for c in cands[len(accepted) :] if c.group_id == g]
            st.cursor[g] = min(rejected, default=pos)
        return self._launch(st, accepted, restore=False)

    def _limit(self, st: ReqState, cands: list[Candidate], count_skipped: bool) -> list[Candidate]:
        """The longest prefix of `cands` that fits and evicts no block of this request's chain
        lying before the block it makes room for (deeper own blocks may go to restore a head)."""
        ctx = self.ctx
        n = min(len(cands), ctx.host.num_free)
        if count_skipped:
            ctx.metrics.num_skipped_pinned_full += len(cands) - n
        for i, key in enumerate(ctx.host.peek_evictions(n)):
            if key is None or key not in st.keys:
                continue
            end = ctx.block_end(cands[i].group_id, cands[i].position)
            if ctx.block_end(key[0], st.keys[key]) < end:
                n = i
                break
        return cands[:n]

    def _plan_restores(self) -> list[Transfer]:
        ctx, budget, out = self.ctx, self.max_restores_per_step, []
        for st in list(self._states.values()):
            if budget <= 0:
                break
            if not st.lost or st.finished:
                continue
            tables = ctx.device_kv.get_blocks(st.request.request_id)
            views = ctx.coordinator.group_hashes(st.request.block_hashes)
            cands: list[Candidate] = []
            for g, pos in sorted(st.lost, key=lambda t: (ctx.block_end(t[0], t[1]), t[0])):
                table, view = tables[g], views[g]
                ok = pos < len(table) and pos < len(view) and table[pos].block_hash == view[pos]
                key = (g, view[pos]) if pos < len(view) else None
                if not ok or key is None or key in self._store_keys or ctx.host.contains(key):
                    st.lost.discard((g, pos))  # device copy gone, or cached again: nothing to do
                    continue
                parent = view[pos - 1] if ctx.chained[g] and pos > 0 else None
                cands.append(Candidate(g, pos, table[pos], key, parent))
            accepted = self._limit(st, cands[:budget], count_skipped=False)
            for c in accepted:
                st.lost.discard((c.group_id, c.position))
                st.restored.add((c.group_id, c.position))
            budget -= len(accepted)
            ctx.metrics.num_restored_blocks += len(accepted)
            out += self._launch(st, accepted, restore=True)
        return out

    def _plan_lazy(self) -> list[Transfer]:
        """Stores of the blocks near the device LRU head that no host entry the device still
        caches makes room for: evicting one would only swap which of two device blocks has a
        host copy, and the evicted one would come back to the scan — with a host smaller than
        the device cache, an idle engine stored and evicted the same blocks forever."""
        ctx = self.ctx
        cands = self._lazy_candidates()
        n = min(len(cands), ctx.host.num_free)
        for i, key in enumerate(ctx.host.peek_evictions(n)):
            if key is not None and ctx.device_kv.get_cached_block(*key) is not None:
                n = i
                break
        ctx.metrics.num_skipped_pinned_full += len(cands) - n
        return self._launch(None, cands[:n], restore=False)

    def _lazy_candidates(self) -> list[Candidate]:
        """Hashed device blocks near the head of the device free queue (the next to be evicted
        there) whose content the host tier neither holds nor is storing.

        The candidates planned leave the queue while their copy runs, so the blocks behind them
        move up to the head: the scan goes on until it has passed `lazy_scan_blocks` blocks that
        *stay* in the queue (unhashed, already on the host or being stored, or beyond the host's
        free room), so the next `lazy_scan_blocks` blocks an allocation takes hold nothing the
        host tier could have kept. Candidates past the host's room are returned too (the caller
        counts them as skipped).
        """
        cands: list[Candidate] = []
        seen: set[Key] = set()
        room = self.ctx.host.num_free
        kept = 0
        for db in self.ctx.device_kv.eviction_order():
            if kept >= self.lazy_scan_blocks:
                break
            h = db.block_hash
            if h is None:
                kept += 1
                continue
            key = (db.group_id, h)
            if key in seen or key in self._store_keys or self.ctx.host.contains(key):
                kept += 1
                continue
            seen.add(key)
            cands.append(Candidate(db.group_id, -1, db, key, None))
            if len(cands) > room:
                kept += 1  # no host block for it: it stays in the queue
        return cands

    def _launch(self, st: ReqState | None, cands: list[Candidate], restore: bool) -> list[Transfer]:
        if not cands:
            return []
        ctx = self.ctx
        host_blocks, evicted = ctx.host.allocate(len(cands))
        ctx.metrics.num_evicted_blocks += len(evicted)
        ctx.metrics.num_orphans_demoted = ctx.host.num_orphans_demoted
        for key in evicted:  # a re-store's own chain is not told (it chose what to evict)
            self.on_evicted(key, notify=True, sparing=st if restore else None)
        device_blocks = [c.device_block for c in cands]
        ctx.device_kv.pin(device_blocks)
        transfer = Transfer(
            ctx.new_transfer_id(),
            "" if st is None else st.request.request_id,
            False,
            [c.group_id for c in cands],
            [b.block_id for b in device_blocks],
            [b.block_id for b in host_blocks],
            sum(ctx.bytes_per_block[c.group_id] for c in cands),
        )
        self._stores[transfer.transfer_id] = StoreRecord(
            transfer, host_blocks, device_blocks, cands
        )
        for c in cands:
            self._store_keys[c.key] = transfer.transfer_id
            if st is not None:
                self._hold(st, c.key, c.position)
        if st is not None:
            st.transfers.add(transfer.transfer_id)
        ctx.metrics.num_pending_stores = len(self._stores)
        return [transfer]

    # ---- holders and eviction notices ----------------------------------------------------------

    def _hold(self, st: ReqState, key: Key, pos: int) -> None:
        st.keys[key] = pos
        self._holders.setdefault(key, set()).add(st.request.request_id)

    def on_evicted(self, key: Key, notify: bool, sparing: ReqState | None = None) -> None:
        """The host dropped `key`: its holders forget it and, if `notify`, re-store it — all but
        `sparing`, and none a position it re-stored before (at most once each: no thrash)."""
        for rid in self._holders.pop(key, ()):
            st = self._states[rid]
            pos = st.keys.pop(key)
            where = (key[0], pos)
            if notify and not st.finished and st is not sparing and where not in st.restored:
                st.lost.add(where)

    def _maybe_drop(self, st: ReqState) -> None:
        if st.finished and not st.transfers:
            rid = st.request.request_id
            for key in st.keys:
                holders = self._holders[key]
                holders.discard(rid)
                if not holders:
                    del self._holders[key]
            del self._states[rid]

    # ---- completion ----------------------------------------------------------------------------

    def complete(self, transfer_id: int) -> None:
        store = self._stores.get(transfer_id)
        if store is None:
            return  # unknown (already ended) ids are ignored: completions may repeat after a fail
        store.reports += 1
        if store.reports < self.ctx.world_size:
            return
        self._finish_store(store, publish=not store.abandoned)

    def fail(self, transfer_id: int) -> None:
        store = self._stores.get(transfer_id)
        if store is None:
            return
        self.ctx.metrics.num_failed_stores += 1
        self._finish_store(store, publish=False)
        for c in store.cands:  # every request holding these keys re-stores them (rate-limited)
            self.on_evicted(c.key, notify=True)

    def take_published(self) -> list[Published]:
        """The blocks published since the last call (with `record_published`; mutates)."""
        out, self._published = self._published, []
        return out

    def _finish_store(self, store: StoreRecord, publish: bool) -> None:
        ctx, t = self.ctx, store.transfer
        del self._stores[t.transfer_id]
        st = self._states.get(t.req_id)
        if publish and self.record_published and st is not None:
            views = ctx.coordinator.group_hashes(st.request.block_hashes)
            for c, hb in zip(store.cands, store.host_blocks):
                self._published.append(
                    Published(
                        c.group_id,
                        c.position,
                        c.key[1],
                        hb.block_id,
                        views[c.group_id],
                        c.device_block.token_ids,
                    )
                )
        for c in store.cands:
            del self._store_keys[c.key]
        if publish:
            for g, spec in enumerate(ctx.specs):
                idx = sorted(
                    (i for i, c in enumerate(store.cands) if c.group_id == g),
                    key=lambda i: store.cands[i].position,
                )
                ctx.host.publish(
                    g,
                    [store.host_blocks[i] for i in idx],
                    [store.cands[i].key[1] for i in idx],
                    [store.cands[i].parent for i in idx],
                    spec.block_size,
                    token_ids=[store.cands[i].device_block.token_ids for i in idx],
                )
            ctx.metrics.num_stored_blocks += t.num_blocks
            ctx.metrics.num_stored_bytes += t.num_bytes
        else:
            ctx.host.pool.free(store.host_blocks)
        ctx.device_kv.unpin(store.device_blocks)
        ctx.metrics.num_orphans_demoted = ctx.host.num_orphans_demoted
        ctx.metrics.num_pending_stores = len(self._stores)
        if st is not None:
            st.transfers.discard(t.transfer_id)
            self._maybe_drop(st)

    # ---- reset, views, integrity ---------------------------------------------------------------

    def abandon_all(self) -> None:
        for store in self._stores.values():
            store.abandoned = True

    def forget_all(self) -> None:
        self._holders.clear()
        for st in self._states.values():
            st.keys.clear()
            st.lost.clear()

    def host_blocks(self) -> list[KVBlock]:
        return [b for s in self._stores.values() for b in s.host_blocks]

    def pinned_device_blocks(self) -> list[KVBlock]:
        return [b for s in self._stores.values() for b in s.device_blocks]

    def check_integrity(self) -> None:
        """Check stores, keys and holders agree; raises `IntegrityError` naming what drifted."""
        keys = {c.key: tid for tid, s in self._stores.items() for c in s.cands}
        if keys != self._store_keys:
            raise IntegrityError("in-flight store keys drifted")
        for s in self._stores.values():
            for b in s.host_blocks:
                if b.block_hash is not None:
                    raise IntegrityError(f"host {b!r} published before its store completed")
        for key, rids in self._holders.items():
            if not rids:
                raise IntegrityError("empty holder set")
            for rid in rids:
                if self._states[rid].keys.get(key) is None:
                    raise IntegrityError(f"holder {rid} without its key")
        for rid, st in self._states.items():
            for key in st.keys:
                if rid not in self._holders.get(key, ()):
                    raise IntegrityError(f"key of {rid} without its holder")
            for tid in st.transfers:
                if tid not in self._stores:
                    raise IntegrityError(f"{rid} lists an ended store {tid}")
        if self.ctx.metrics.num_pending_stores != len(self._stores):
            raise IntegrityError(
                f"pending-store count drifted: {self.ctx.metrics.num_pending_stores} counted, "
                f"{len(self._stores)} stores"
            )
