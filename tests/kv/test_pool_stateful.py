"""Hypothesis state machines: the real BlockPool (quarantine on) beside a plain-dict model, and the
KVCacheManager (full + sliding window / chunked local / mamba) checked for I1, I2, I4 and I5 after
every rule."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.kv import (
    BlockPool,
    ChunkedLocal,
    FullAttention,
    KVCacheManager,
    KVSpec,
    Mamba,
    SlidingWindow,
)

N = 12  # blocks, null included
HASHES = [f"h{i}".encode() for i in range(5)]  # few values: duplicates are common


class PoolMachine(RuleBasedStateMachine):
    """Model: ref counts per block id, the free queue as a list (head first), quarantine entries
    (stamp, seq, ids), hash per block and hash → set of ids; `handles` are references we hold."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, enable_caching=True, enable_quarantine=True)
        self.refs = {i: 0 for i in range(1, N)}
        self.order = list(range(1, N))
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, set[int]] = {}
        self.quarantine: list[tuple[int, int, list[int]]] = []
        self.seq = 0
        self.processed = 0
        self.handles: list[list[int]] = []

    # ---- model helpers ---------------------------------------------------------------------------

    def _quarantined(self) -> set[int]:
        return {i for _, _, ids in self.quarantine for i in ids}

    def _uncache(self, block_id: int) -> None:
        h = self.hash_of.pop(block_id, None)
        if h is not None:
            self.cached[h].discard(block_id)
            if not self.cached[h]:
                del self.cached[h]

    def _release(self, ids: list[int]) -> None:
        fresh, cached = [], []
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                (cached if i in self.hash_of else fresh).append(i)
        self.order = fresh + self.order + cached

    def _allocate(self, n: int) -> None:
        if n > len(self.order):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        got = [b.block_id for b in self.pool.get_new_blocks(n)]
        quarantined = self._quarantined()
        event("allocate while blocks are quarantined" if quarantined else "allocate")
        for i in got:
            assert self.refs[i] == 0, f"allocation returned block {i} with model ref {self.refs[i]}"
            assert i not in quarantined, f"allocation returned quarantined block {i}"
        assert got == self.order[:n], "allocation must pop the LRU head"
        for i in got:
            self._uncache(i)
            self.refs[i] = 1
        self.order = self.order[n:]
        self.handles.append(got)

    def _free(self, handle: list[int], delta: int | None) -> None:
        stamp = None if delta is None else self.processed + delta
        self.pool.free([self.pool.blocks[i] for i in handle], stamp)
        if stamp is not None and stamp > self.processed:
            self.quarantine.append((stamp, self.seq, handle))
            self.seq += 1
        else:
            self._release(handle)

    # ---- rules -----------------------------------------------------------------------------------

    @rule(n=st.integers(1, 6))
    def allocate(self, n: int) -> None:
        self._allocate(n)

    @rule()
    def allocate_everything_free(self) -> None:
        if self.order:
            self._allocate(len(self.order))

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.cached)))
        block = self.pool.get_cached_block(0, h)
        assert block is not None and block.block_id in self.cached[h]
        self.pool.touch([block])
        event(f"touch cached block with ref {self.refs[block.block_id]}")
        if block.block_id in self._quarantined():
            event("touch quarantined cached block")
        if self.refs[block.block_id] == 0:
            self.order.remove(block.block_id)
        self.refs[block.block_id] += 1
        self.handles.append([block.block_id])

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.handles))
        drawn = data.draw(
            st.lists(st.sampled_from(HASHES), min_size=len(handle), max_size=len(handle))
        )
        # a block that already carries a hash must be given that hash again
        hashes = [self.hash_of.get(i, h) for i, h in zip(handle, drawn)]
        start = data.draw(st.integers(0, len(handle)))
        self.pool.cache_full_blocks(
            0, [self.pool.blocks[i] for i in handle], hashes, start, len(handle), 4
        )
        for i, h in list(zip(handle, hashes))[start:]:
            if i not in self.hash_of:
                self.hash_of[i] = h
                self.cached.setdefault(h, set()).add(i)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), delta=st.one_of(st.none(), st.integers(-2, 4)))
    def free(self, data: st.DataObject, delta: int | None) -> None:
        self._free(self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1))), delta)

    @precondition(lambda self: self.handles)
    @rule(delta=st.one_of(st.none(), st.integers(-1, 3)))
    def free_every_handle(self, delta: int | None) -> None:
        """Like a batch of requests finishing in one step (makes evictable and quarantined
        cached blocks common, so touches and allocations meet them)."""
        while self.handles:
            self._free(self.handles.pop(), delta)

    @rule(advance=st.integers(-1, 2))
    def release_quarantine(self, advance: int) -> None:
        released = self.pool.release_quarantine(self.processed + advance)
        self.processed = max(self.processed, self.processed + advance)
        due = sorted(e for e in self.quarantine if e[0] <= self.processed)
        self.quarantine = [e for e in self.quarantine if e[0] > self.processed]
        for _, _, ids in due:
            self._release(ids)
        assert released == sum(len(ids) for _, _, ids in due)

    @rule(ids=st.lists(st.integers(1, N - 1), max_size=3))
    def evict_blocks(self, ids: list[int]) -> None:
        self.pool.evict_blocks(ids)
        for i in ids:
            self._uncache(i)

    @rule()
    def reset_prefix_cache(self) -> None:
        expected = all(r == 0 for r in self.refs.values())
        event(f"reset_prefix_cache -> {expected}")
        assert self.pool.reset_prefix_cache() is expected
        if expected:
            self.hash_of.clear()
            self.cached.clear()

    # ---- the comparison --------------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        p = self.pool
        p.check_integrity()
        assert p.free_queue.block_ids() == self.order
        assert p.num_free_blocks == len(self.order)
        assert {b.block_id: b.ref_cnt for b in p.blocks[1:]} == self.refs
        assert sorted(p.quarantined_block_ids()) == sorted(
            i for _, _, ids in self.quarantine for i in ids
        )
        quarantine_refs: dict[int, int] = {}
        for _, _, ids in self.quarantine:
            for i in ids:
                quarantine_refs[i] = quarantine_refs.get(i, 0) + 1
        freeable = sum(1 for i, n in quarantine_refs.items() if self.refs[i] == n)
        assert p.num_quarantined_freeable() == freeable
        assert p.processed_step_seq == self.processed
        assert {
            b.block_id: b.block_hash for b in p.blocks if b.block_hash is not None
        } == self.hash_of
        for h in HASHES:
            got = p.get_cached_block(0, h)
            if h in self.cached:
                assert got is not None and got.block_id in self.cached[h]
            else:
                assert got is None
        assert p.num_cached_entries() == sum(len(s) for s in self.cached.values())


PoolMachine.TestCase.settings = settings(stateful_step_count=30)
TestBlockPoolAgainstModel = PoolMachine.TestCase


# ---- KVCacheManager machine --------------------------------------------------------------------------

BS, W = 4, 8
PREFIXES = [[p * 1000 + i for i in range(40)] for p in range(3)]


class ManagerMachine(RuleBasedStateMachine):
    """Requests share prefixes (so hits happen), are prefilled in chunks, decode, prune on the
    settled count, finish; steps are processed later (async). Checks after every rule:
    I1/I5 (check_integrity), I2 (no allocation returns a block some unprocessed step saw) and I4
    (every window block a future query at or after the settled count reads is real)."""

    specs: tuple[KVSpec, ...] = (FullAttention(BS), SlidingWindow(BS, W))

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(list(self.specs), 28, max_model_len=64, max_in_flight_tokens=8)
        self.reqs: dict[str, object] = {}
        self.history: dict[str, list[tuple[int, int]]] = {}  # req → [(step seq, computed after)]
        self.step_blocks: dict[int, set[int]] = {}  # step seq → block ids its tables held
        self.sched_seq = 0
        self.processed = 0
        self.next_id = 0
        self.next_token = 10**6

    def _settled(self, req_id: str) -> int:
        return max((c for s, c in self.history[req_id] if s <= self.processed), default=0)

    def _schedule(self, seq, n: int, **kw) -> bool:
        m = self.m
        busy = {i for s, ids in self.step_blocks.items() if s > self.processed for i in ids}
        before = (m.pool.free_queue.block_ids(), m.get_block_ids(seq.request_id))
        new = m.allocate_slots(seq, n, **kw)
        event("allocate_slots refused" if new is None else "allocate_slots")
        if m.pool.num_quarantined_refs:
            event("allocate_slots while blocks are quarantined")
        if new is None:
            assert (m.pool.free_queue.block_ids(), m.get_block_ids(seq.request_id)) == before
            return False
        got = {b.block_id for g in new for b in g if not b.is_null}
        assert not got & busy, f"I2: allocated {got & busy} still used by an unprocessed step"
        self.sched_seq += 1
        seq.num_computed_tokens += n + kw.get("num_new_computed_tokens", 0)
        self.history.setdefault(seq.request_id, []).append(
            (self.sched_seq, seq.num_computed_tokens)
        )
        self.step_blocks[self.sched_seq] = {
            i for g in m.get_block_ids(seq.request_id) for i in g if i != 0
        }
        return True

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 40), chunk=st.integers(1, 16))
    def admit(self, prefix: int, length: int, chunk: int) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        seq = self.m.new_sequence(req_id, PREFIXES[prefix][:length])
        hits, num_hit = self.m.get_computed_blocks(seq)
        if num_hit:
            event("admit with a prefix hit")
        n = min(chunk, length - num_hit)
        self.history[req_id] = [(0, num_hit)]  # hit tokens count as settled for this request
        if self._schedule(seq, n, num_new_computed_tokens=num_hit, new_computed_blocks=hits):
            self.reqs[req_id] = seq

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def step(self, data: st.DataObject, chunk: int) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        seq = self.reqs[req_id]
        if seq.num_computed_tokens >= 60:
            return
        if seq.num_computed_tokens >= seq.num_tokens:  # decode: the sampled token is known
            seq.append_output_token_ids([self.next_token])
            self.next_token += 1
        self._schedule(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def prune(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        last = self.history[req_id][-1][0]
        self.m.remove_skipped_blocks(req_id, self._settled(req_id), last)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[req_id]
        self.m.free(req_id, self.history[req_id][-1][0])

    @precondition(lambda self: self.processed < self.sched_seq)
    @rule(n=st.integers(1, 2))
    def process(self, n: int) -> None:
        self.processed = min(self.sched_seq, self.processed + n)
        self.m.release_quarantine(self.processed)

    @precondition(lambda self: self.processed < self.sched_seq)
    @rule()
    def update(self) -> None:
        """update(k) (architecture.md §Walks): process one step, prune every request on its settled
        count."""
        self.processed += 1
        for req_id in sorted(self.reqs):
            last = self.history[req_id][-1][0]
            if self.m.remove_skipped_blocks(req_id, self._settled(req_id), last):
                event("pruned in update")
        self.m.release_quarantine(self.processed)

    @invariant()
    def safe(self) -> None:
        self.m.check_integrity()
        for req_id in self.reqs:
            table = self.m.get_blocks(req_id)[1]
            settled = self._settled(req_id)
            assert self.readable(table, settled), f"I4: {req_id} lost blocks at settled {settled}"

    def readable(self, table: list, settled: int) -> bool:
        """Every block a query at or after `settled` reads is real (independent of specs.py)."""
        return not any(b.is_null for b in table[max(0, settled - W + 1) // BS :])


class ChunkedManagerMachine(ManagerMachine):
    specs = (FullAttention(BS), ChunkedLocal(BS, 8))

    def readable(self, table: list, settled: int) -> bool:
        return not any(b.is_null for b in table[settled // 8 * 8 // BS :])


class MambaManagerMachine(ManagerMachine):
    specs = (FullAttention(BS), Mamba(BS))

    def readable(self, table: list, settled: int) -> bool:
        return settled == 0 or not table[(settled - 1) // BS].is_null


for _machine in (ManagerMachine, ChunkedManagerMachine, MambaManagerMachine):
    _machine.TestCase.settings = settings(stateful_step_count=30)
TestKVCacheManagerMachine = ManagerMachine.TestCase
TestChunkedLocalManagerMachine = ChunkedManagerMachine.TestCase
TestMambaManagerMachine = MambaManagerMachine.TestCase
