"""Hypothesis state machine over the host tier with a hybrid device (full + sliding window):
admissions with device and host hits, decodes, settling, window pruning, store plans, transfer
completions in any order, failures, finishes, preemptions and resumptions, resets. After every
rule: host ref counts have exactly their holders, device pins are backed (I3), pools are sound."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.kv import FullAttention, KVCacheManager, KVSpec, SlidingWindow
from kvtier.offload import HostTier, Transfer
from kvtier.sched.request import Request, RequestStatus, StepRecord

PREFIXES = [[1000 * k + i for i in range(16)] for k in range(3)]


class HostTierMachine(RuleBasedStateMachine):
    SPECS: tuple[KVSpec, ...] = (FullAttention(4),)

    def __init__(self) -> None:
        super().__init__()
        self.dev = KVCacheManager(list(self.SPECS), 24, max_model_len=256)
        self.t = HostTier(
            self.dev, 14, max_restores_per_step=2, bytes_per_block=[8] * len(self.SPECS)
        )
        self.ids = itertools.count()
        self.fresh = itertools.count(10**6)
        self.step = 1
        self.running: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}
        self.preempted: dict[str, Request] = {}
        self.outstanding: dict[int, Transfer] = {}

    # ---- helpers -------------------------------------------------------------------------------

    def _track(self, transfers: list[Transfer]) -> None:
        for x in transfers:
            assert x.transfer_id not in self.outstanding
            self.outstanding[x.transfer_id] = x

    def _start(self, req: Request) -> None:
        n = req.num_tokens - req.num_computed_tokens
        req.num_computed_tokens = req.num_tokens
        req.ledger.append(StepRecord(self.step, n, 0, 1))
        self.step += 1
        req.status = RequestStatus.RUNNING
        self.running[req.request_id] = req

    def _admit(self, req: Request, fewer: bool = False) -> None:
        hits, num_hit = self.dev.get_computed_blocks(req)
        answer = self.t.lookup(req, num_hit)
        if fewer and answer.num_tokens > 4:  # the scheduler accepts one block less
            answer = self.t.lookup(req, num_hit, max_external_tokens=answer.num_tokens - 4)
        if answer.wait_for_load:
            assert answer.num_tokens == 0
            self._track(self.t.finish_request(req))  # would stay waiting: aborted here
            return
        ext = answer.num_tokens
        assert ext % 4 == 0 and num_hit + ext < req.num_tokens
        new = req.num_tokens - num_hit - ext
        got = self.dev.allocate_slots(
            req,
            new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_external_computed_tokens=ext,
            delay_cache_blocks=ext > 0,
        )
        if got is None:
            assert self.t.plan_load(req, 0) is None
            self._track(self.t.finish_request(req))
            return
        req.num_computed_tokens = num_hit + ext
        load = self.t.plan_load(req, ext)
        if load is None:
            self._start(req)
            return
        assert load.is_load and 0 not in load.src_block_ids + load.dst_block_ids
        assert self.t.is_loading(req.request_id) and req.status is RequestStatus.WAITING
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # as the scheduler parks it
        self.loading[req.request_id] = req
        self._track([load])

    def _pick(self, pool: dict[str, Request], i: int) -> Request:
        return pool[sorted(pool)[i % len(pool)]]

    def _end(self, req: Request, finished: bool) -> None:
        rid = req.request_id
        if finished:
            self._track(self.t.finish_request(req))
        else:
            self._track(self.t.preempt_request(req))
        self.dev.free(rid)
        self.running.pop(rid, None)
        self.loading.pop(rid, None)

    # ---- rules ---------------------------------------------------------------------------------

    @rule(
        k=st.integers(0, 2),
        prefix=st.integers(0, 16),
        suffix=st.integers(1, 10),
        fewer=st.booleans(),
    )
    def admit(self, k: int, prefix: int, suffix: int, fewer: bool) -> None:
        toks = PREFIXES[k][:prefix] + [next(self.fresh) for _ in range(suffix)]
        self._admit(Request(f"r{next(self.ids)}", toks, hasher=self.dev.hasher), fewer)

    @rule(k=st.integers(0, 2), suffix=st.integers(1, 6), forget=st.booleans())
    def serve_and_finish(self, k: int, suffix: int, forget: bool) -> None:
        """A whole request in one go: admit, settle, store, complete its stores, finish (and
        maybe let the device forget): the host tier then holds its prefix for later lookups."""
        req = Request(
            f"r{next(self.ids)}",
            PREFIXES[k] + [next(self.fresh) for _ in range(suffix)],
            hasher=self.dev.hasher,
        )
        self._admit(req)
        if req.request_id not in self.running:
            return
        while len(req.ledger):
            req.ledger.consume(req.ledger.records[0].step_seq)
        transfers = self.t.plan_stores([req])
        self._track(transfers)
        for x in [x for x in transfers if x.req_id == req.request_id]:
            del self.outstanding[x.transfer_id]
            assert self.t.complete([x.transfer_id]) == []
        self._end(req, finished=True)
        if forget:
            self.forget_device_cache()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def decode(self, i: int) -> None:
        req = self._pick(self.running, i)
        if len(req.ledger) >= 2:
            return
        req.append_output_token_ids([next(self.fresh)])
        if self.dev.allocate_slots(req, 1) is None:
            self._end(req, finished=True)
            return
        req.num_computed_tokens += 1
        req.ledger.append(StepRecord(self.step, 1, 0, 1))
        self.step += 1

    @precondition(lambda self: any(len(r.ledger) for r in self.running.values()))
    @rule(i=st.integers(0, 50))
    def process(self, i: int) -> None:
        busy = {rid: r for rid, r in self.running.items() if len(r.ledger)}
        req = self._pick(busy, i)
        req.ledger.consume(req.ledger.records[0].step_seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def prune(self, i: int) -> None:
        req = self._pick(self.running, i)
        self.dev.remove_skipped_blocks(req.request_id, req.num_settled_tokens)

    @rule()
    def plan_stores(self) -> None:
        transfers = self.t.plan_stores(list(self.running.values()))
        for x in transfers:
            assert not x.is_load and 0 not in x.src_block_ids + x.dst_block_ids
            req = self.running.get(x.req_id)
            if req is None:
                continue
            settled = req.num_computed_tokens - req.ledger.num_in_flight_tokens
            tables = self.dev.get_block_ids(x.req_id)
            for g, d in zip(x.group_ids, x.src_block_ids):
                end = (tables[g].index(d) + 1) * self.SPECS[g].block_size
                assert end <= settled, "stored a block the device may not have finished (H1)"
        self._track(transfers)

    @precondition(lambda self: self.outstanding)
    @rule(i=st.integers(0, 50))
    def complete(self, i: int) -> None:
        tid = sorted(self.outstanding)[i % len(self.outstanding)]
        del self.outstanding[tid]
        for rid in self.t.complete([tid]):
            req = self.loading.pop(rid)
            assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS  # the tier left it alone
            assert not self.t.is_loading(rid)
            req.status = RequestStatus.WAITING
            self.dev.cache_blocks(req, req.num_computed_tokens)
            self._start(req)

    @precondition(lambda self: self.outstanding)
    @rule(i=st.integers(0, 50))
    def fail(self, i: int) -> None:
        tid = sorted(self.outstanding)[i % len(self.outstanding)]
        del self.outstanding[tid]
        failure = self.t.fail(tid)
        if failure is None:
            return
        req = self.loading.pop(failure.req_id)
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS  # the tier left it alone
        align = self.t.coordinator.alignment
        assert failure.num_good_tokens % align == 0
        assert failure.num_good_tokens < req.num_computed_tokens  # rolled back
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = failure.num_good_tokens  # as the scheduler applies it
        self.dev.evict_blocks(failure.evict_device_block_ids)
        if failure.must_reallocate:
            assert failure.num_good_tokens == 0
            self._track(self.t.finish_request(req))
            self.dev.free(req.request_id)
            return
        self._start(req)

    @precondition(lambda self: self.running or self.loading)
    @rule(i=st.integers(0, 50))
    def finish(self, i: int) -> None:
        self._end(self._pick({**self.running, **self.loading}, i), finished=True)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def preempt(self, i: int) -> None:
        req = self._pick(self.running, i)
        self._end(req, finished=False)
        req.ledger.mark_stale()
        self.preempted[req.request_id] = req

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 50))
    def resume(self, i: int) -> None:
        req = self._pick(self.preempted, i)
        del self.preempted[req.request_id]
        for record in list(req.ledger.records):
            req.ledger.consume(record.step_seq)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._admit(req)

    @rule()
    def forget_device_cache(self) -> None:
        """The device LRU evicted every free cached block (only the host tier may have them)."""
        self.dev.pool.evict_blocks([b.block_id for b in self.dev.pool.free_queue])

    @rule()
    def reset(self) -> None:
        if self.t.reset_cache():
            assert self.t.host.pool.num_cached_entries() == 0

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def sound(self) -> None:
        self.t.check_integrity()
        self.dev.check_integrity(num_pinned=self.t.device_pins())
        m = self.t.metrics
        assert m.num_pending_loads + m.num_pending_stores == len(self.outstanding)
        assert m.num_hit_tokens <= m.num_query_tokens

    def teardown(self) -> None:
        live = [*self.running.values(), *self.loading.values(), *self.preempted.values()]
        self.t.complete(sorted(self.outstanding))
        self.outstanding.clear()
        for req in live:
            self._track(self.t.finish_request(req))
            self.dev.free(req.request_id)
        self.t.complete(sorted(self.outstanding))
        assert not self.t.device_pins() and not self.t.has_pending_stores
        assert all(b.ref_cnt == 0 for b in self.t.host.pool.blocks)
        assert all(self.t.store_progress(r.request_id) is None for r in live)
        assert self.t.pool_stats()[1].is_idle
        self.t.check_integrity()
        self.dev.check_integrity()


class HybridHostTierMachine(HostTierMachine):
    SPECS: tuple[KVSpec, ...] = (FullAttention(4), SlidingWindow(4, 8))


_settings = settings(settings.get_profile("ci"), stateful_step_count=30)
HostTierMachine.TestCase.settings = _settings
HybridHostTierMachine.TestCase.settings = _settings
TestHostTierFullAttention = HostTierMachine.TestCase
TestHostTierHybrid = HybridHostTierMachine.TestCase
