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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier.kv.block import KVBlock
from kvtier.offload.store_records import (
    Candidate,
    ReqState,
    StoreProgress,
    StoreRecord,
    lazy_candidates,
)
from kvtier.offload.types import Key, Transfer
from kvtier.sched.request import Request

if TYPE_CHECKING:
    from kvtier.offload.tier import HostTier


class StorePlanner:
    def __init__(self, tier: HostTier, max_restores_per_step: int, lazy_scan_blocks: int) -> None:
        self.tier = tier
        self.max_restores_per_step = max_restores_per_step
        self.lazy_scan_blocks = lazy_scan_blocks
        self._states: dict[str, ReqState] = {}
        self._stores: dict[int, StoreRecord] = {}
        self._holders: dict[Key, set[str]] = {}  # key -> requests whose chain includes it

    @property
    def num_in_flight(self) -> int:
        return len(self._stores)

    def progress(self, request_id: str) -> StoreProgress | None:
        st = self._states.get(request_id)
        if st is None:
            return None
        return StoreProgress(tuple(st.cursor), frozenset(st.lost), len(st.transfers), st.finished)

    # ---- planning ------------------------------------------------------------------------------

    def plan(self, requests: Iterable[Request]) -> list[Transfer]:
        out: list[Transfer] = []
        if not self.tier.enabled:
            return out
        out += self._plan_restores()  # losses of earlier steps first: heads before new tails
        if self.tier.store_mode == "lazy":
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
        if not self.tier.enabled or self.tier.store_mode == "lazy":
            return []
        st = self._state(request)
        return [] if st.finished else self._plan_request(st)

    def flush(self, request: Request, finished: bool) -> list[Transfer]:
        st = self._states.get(request.request_id)
        if st is None or not self.tier.enabled or self.tier.store_mode == "lazy":
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
            st = self._states[request.request_id] = ReqState(request, [0] * len(self.tier.specs))
        st.request = request
        return st

    def _plan_request(self, st: ReqState) -> list[Transfer]:
        tier, req = self.tier, st.request
        tables = tier.device.get_blocks(req.request_id)
        views = tier.coordinator.group_hashes(req.block_hashes)
        if tier.store_from_settled:  # stale records count too: never ahead of the device
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
        for g, spec in enumerate(tier.specs):
            bs, table, view = spec.block_size, tables[g], views[g]
            pos, end = st.cursor[g], min(settled // bs, len(view), len(table))
            while pos < end:
                db, h = table[pos], view[pos]
                if not db.is_null:
                    if db.block_hash != h:
                        break  # not published on the device yet: retry next step
                    key = (g, h)
                    if key in tier._store_keys or tier.host.contains(key):
                        tier.metrics.num_deduped_blocks += 1
                        self._hold(st, key, pos)
                    else:
                        parent = view[pos - 1] if tier.chained[g] and pos > 0 else None
                        cands.append(Candidate(g, pos, db, key, parent))
                pos += 1
            stop.append(pos)
        cands.sort(key=lambda c: (self._end(c.group_id, c.position), c.group_id))
        accepted = self._limit(st, cands, count_skipped=True)
        for g, pos in enumerate(stop):  # the cursor stops at the first candidate not planned
            rejected = [c.position for c in cands[len(accepted) :] if c.group_id == g]
            st.cursor[g] = min(rejected, default=pos)
        return self._launch(st, accepted, restore=False)

    def _limit(self, st: ReqState, cands: list[Candidate], count_skipped: bool) -> list[Candidate]:
        """The longest prefix of `cands` that fits and evicts no block of this request's chain
        lying before the block it makes room for (deeper own blocks may go to restore a head)."""
        n = min(len(cands), self.tier.host.num_free)
        if count_skipped:
            self.tier.metrics.num_skipped_pinned_full += len(cands) - n
        for i, key in enumerate(self.tier.host.peek_evictions(n)):
            if key is None or key not in st.keys:
                continue
            if self._end(key[0], st.keys[key]) < self._end(cands[i].group_id, cands[i].position):
                n = i
                break
        return cands[:n]

    def _end(self, group_id: int, position: int) -> int:  # token count a position ends at
        return (position + 1) * self.tier.specs[group_id].block_size

    def _plan_restores(self) -> list[Transfer]:
        tier, budget, out = self.tier, self.max_restores_per_step, []
        for st in list(self._states.values()):
            if budget <= 0:
                break
            if not st.lost or st.finished:
                continue
            tables = tier.device.get_blocks(st.request.request_id)
            views = tier.coordinator.group_hashes(st.request.block_hashes)
            cands: list[Candidate] = []
            for g, pos in sorted(st.lost, key=lambda t: (self._end(t[0], t[1]), t[0])):
                table, view = tables[g], views[g]
                ok = pos < len(table) and pos < len(view) and table[pos].block_hash == view[pos]
                key = (g, view[pos]) if pos < len(view) else None
                if not ok or key is None or key in tier._store_keys or tier.host.contains(key):
                    st.lost.discard((g, pos))  # device copy gone, or cached again: nothing to do
                    continue
                parent = view[pos - 1] if tier.chained[g] and pos > 0 else None
                cands.append(Candidate(g, pos, table[pos], key, parent))
            accepted = self._limit(st, cands[:budget], count_skipped=False)
            for c in accepted:
                st.lost.discard((c.group_id, c.position))
                st.restored.add((c.group_id, c.position))
            budget -= len(accepted)
            tier.metrics.num_restored_blocks += len(accepted)
            out += self._launch(st, accepted, restore=True)
        return out

    def _plan_lazy(self) -> list[Transfer]:
        """Stores of the blocks near the device LRU head that no host entry the device still
        caches makes room for: evicting one would only swap which of two device blocks has a
        host copy, and the evicted one would come back to the scan — with a host smaller than
        the device cache, an idle engine stored and evicted the same blocks forever."""
        tier = self.tier
        cands = lazy_candidates(tier, self.lazy_scan_blocks)
        n = min(len(cands), tier.host.num_free)
        for i, key in enumerate(tier.host.peek_evictions(n)):
            if key is not None and tier.device.pool.get_cached_block(*key) is not None:
                n = i
                break
        tier.metrics.num_skipped_pinned_full += len(cands) - n
        return self._launch(None, cands[:n], restore=False)

    def _launch(self, st: ReqState | None, cands: list[Candidate], restore: bool) -> list[Transfer]:
        if not cands:
            return []
        tier = self.tier
        host_blocks, evicted = tier.host.allocate(len(cands))
        tier.metrics.num_evicted_blocks += len(evicted)
        tier.metrics.num_orphans_demoted = tier.host.num_orphans_demoted
        for key in evicted:  # a re-store's own chain is not told (it chose what to evict)
            self.on_evicted(key, notify=True, sparing=st if restore else None)
        device_blocks = [c.device_block for c in cands]
        tier.device.pool.touch(device_blocks)
        transfer = Transfer(
            tier.new_transfer_id(),
            "" if st is None else st.request.request_id,
            False,
            [c.group_id for c in cands],
            [b.block_id for b in device_blocks],
            [b.block_id for b in host_blocks],
            sum(tier.bytes_per_block[c.group_id] for c in cands),
        )
        self._stores[transfer.transfer_id] = StoreRecord(
            transfer, host_blocks, device_blocks, cands
        )
        for c in cands:
            tier._store_keys[c.key] = transfer.transfer_id
            if st is not None:
                self._hold(st, c.key, c.position)
        if st is not None:
            st.transfers.add(transfer.transfer_id)
        tier.metrics.num_pending_stores = len(self._stores)
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
        if store.reports < self.tier.world_size:
            return
        self._finish_store(store, publish=not store.abandoned)

    def fail(self, transfer_id: int) -> None:
        store = self._stores.get(transfer_id)
        if store is None:
            return
        self.tier.metrics.num_failed_stores += 1
        self._finish_store(store, publish=False)
        for c in store.cands:  # every request holding these keys re-stores them (rate-limited)
            self.on_evicted(c.key, notify=True)

    def _finish_store(self, store: StoreRecord, publish: bool) -> None:
        tier, t = self.tier, store.transfer
        del self._stores[t.transfer_id]
        for c in store.cands:
            del tier._store_keys[c.key]
        if publish:
            for g, spec in enumerate(tier.specs):
                idx = sorted(
                    (i for i, c in enumerate(store.cands) if c.group_id == g),
                    key=lambda i: store.cands[i].position,
                )
                tier.host.publish(
                    g,
                    [store.host_blocks[i] for i in idx],
                    [store.cands[i].key[1] for i in idx],
                    [store.cands[i].parent for i in idx],
                    spec.block_size,
                )
            tier.metrics.num_stored_blocks += t.num_blocks
            tier.metrics.num_stored_bytes += t.num_bytes
        else:
            tier.host.pool.free(store.host_blocks)
        tier.device.pool.free(store.device_blocks)
        tier.metrics.num_orphans_demoted = tier.host.num_orphans_demoted
        tier.metrics.num_pending_stores = len(self._stores)
        st = self._states.get(t.req_id)
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
        tier = self.tier
        keys = {c.key: tid for tid, s in self._stores.items() for c in s.cands}
        assert keys == tier._store_keys, "in-flight store keys drifted"
        for s in self._stores.values():
            for b in s.host_blocks:
                assert b.block_hash is None, f"host {b!r} published before its store completed"
        for key, rids in self._holders.items():
            assert rids, "empty holder set"
            for rid in rids:
                assert self._states[rid].keys.get(key) is not None, "holder without its key"
        for rid, st in self._states.items():
            for key in st.keys:
                assert rid in self._holders.get(key, ()), "key without its holder"
            for tid in st.transfers:
                assert tid in self._stores, "request lists an ended store"
        assert tier.metrics.num_pending_stores == len(self._stores)
