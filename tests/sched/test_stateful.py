"""Hypothesis state machine: arrivals, aborts, preemptions under a tight pool, draft rejections,
sync and async depth 2-3, every admission policy; every invariant after every call, and at the
end liveness (architecture.md §Progress): with no new arrival every request finishes, none
waiting more than a bounded number of engine steps for a token. With every protection off the
same machine must find an I2 or I4 violation."""

from __future__ import annotations

import zlib
from collections import deque

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.bench.fake_runner import FakeRunner
from kvtier.ids import ReqId
from kvtier.kv import ChunkedLocal, FullAttention, KVCacheManager, KVSpec, Mamba, SlidingWindow
from kvtier.kv.specs import admission_policy
from kvtier.sampling import StopConditions
from kvtier.sched import Request, RunnerOutput, Scheduler, SchedulerOutput
from tests.sched.invariants import check_scheduler, window_violations
from tests.sched.oracle import AccessOracle

SPECS: list[list[KVSpec]] = [
    [FullAttention(4)],
    [SlidingWindow(4, 8)],
    [ChunkedLocal(4, 8)],
    [FullAttention(4), SlidingWindow(4, 6)],
    [Mamba(4)],
    [FullAttention(4), Mamba(4)],
]
SHARED = list(range(500, 512))  # three blocks of a common prefix
# Engine steps a request may wait for a token while draining: far above any schedule of the few
# short requests a run holds (a livelock never ends, so any bound finds it).
LIVENESS_BOUND = 2000


def pattern_token(req_id: str, position: int) -> int:
    return 50 + (zlib.crc32(req_id.encode()) % 3 + position % 4) % 6  # short period: drafts match


class SchedulerMachine(RuleBasedStateMachine):
    settled = True  # prune windows on the settled count (False: on the optimistic count)
    quarantine = True  # hold request-level frees until their fence step is processed
    direct_i4 = True  # also check I4 on the host tables (conservative: any query ≥ settled)

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.in_flight: deque[tuple[SchedulerOutput, RunnerOutput]] = deque()
        self.num_ids = 0
        self.num_idle_steps: dict[ReqId, int] = {}  # while draining: steps since its last token

    @initialize(
        specs=st.sampled_from(SPECS),
        depth=st.sampled_from([1, 2, 3]),
        num_blocks=st.integers(6, 14),
        caching=st.booleans(),
        k=st.sampled_from([0, 0, 2, 3]),
        acceptance=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
        threshold=st.sampled_from([0, 0, 5]),
        reserve=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        admission=st.sampled_from(["shared", "per-request", "optimistic"]),
    )
    def setup(
        self,
        specs: list[KVSpec],
        depth: int,
        num_blocks: int,
        caching: bool,
        k: int,
        acceptance: float,
        threshold: int,
        reserve: bool,
        policy: str,
        admission: str,
    ) -> None:
        budget = 12
        # Without the in-flight bound the pool is sized without its transient need (a Mamba
        # group holds its last state block and the next one across a step): a request the
        # sizing admits may never fit, so liveness is checked only with it (§Progress).
        self.reserve = reserve
        kv = KVCacheManager(
            specs,
            num_blocks,
            max_model_len=64,
            enable_caching=caching,
            enable_quarantine=self.quarantine,
            max_in_flight_tokens=depth * budget if reserve else 0,
            admission=admission_policy(admission, budget),
        )
        self.sched = Scheduler(
            kv,
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            async_depth=depth,
            long_prefill_token_threshold=threshold,
            num_speculative_tokens=k,
            policy=policy,
            settled=self.settled,
        )
        self.oracle = AccessOracle(specs, kv.get_block_ids)
        self.runner = FakeRunner(
            token_fn=pattern_token,
            acceptance_rate=acceptance,
            oracle=self.oracle,
            num_speculative_tokens=max(k, 1),
        )

    @property
    def s(self) -> Scheduler:
        assert self.sched is not None
        return self.sched

    @rule(
        prompt_len=st.integers(1, 20),
        max_tokens=st.integers(1, 24),
        shared=st.booleans(),
        ngram=st.booleans(),
        stop=st.booleans(),
        priority=st.integers(0, 2),
    )
    def arrive(
        self, prompt_len: int, max_tokens: int, shared: bool, ngram: bool, stop: bool, priority: int
    ) -> None:
        self.num_ids += 1
        req_id = f"r{self.num_ids}"
        prompt = (SHARED if shared else []) + [1000 * self.num_ids + j for j in range(prompt_len)]
        stops = (pattern_token(req_id, len(prompt) + 2),) if stop else ()
        sp = StopConditions(max_tokens=max_tokens, stop_token_ids=stops, use_ngram=ngram)
        try:
            self.s.add_request(Request(req_id, prompt, sp, priority=priority))
        except ValueError as e:  # a request that could never fit this pool is refused up front
            assert "KV blocks" in str(e) or "max_model_len" in str(e)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(k for k, r in self.s.requests.items() if not r.is_finished)
        if live:
            assert self.s.abort(data.draw(st.sampled_from(live)))

    @precondition(lambda self: self.sched is not None and self.sched.can_schedule())
    @rule()
    def schedule(self) -> None:
        out = self.s.schedule()
        self.in_flight.append((out, self.runner.execute(out)))

    @precondition(lambda self: bool(self.in_flight))
    @rule()
    def process(self) -> None:
        out, result = self.in_flight.popleft()
        for update in self.s.update(out, result):
            if update.new_token_ids:
                self.num_idle_steps[update.req_id] = 0
        self.runner.on_processed(out.step_seq)

    @rule()
    def engine_step(self) -> None:
        """What the engine loop does: fill the batch queue first, else collect the oldest."""
        if self.sched is None:
            return
        if self.s.can_schedule() and self.s.has_unfinished_requests():
            self.schedule()
        elif self.in_flight:
            self.process()

    @rule()
    def engine_steps(self) -> None:
        for _ in range(4):
            self.engine_step()

    @invariant()
    def every_invariant_holds(self) -> None:
        if self.sched is None:
            return
        check_scheduler(self.sched)
        assert not self.oracle.violations, f"oracle: {self.oracle.violations}"
        if self.direct_i4:
            assert not (found := window_violations(self.sched)), f"I4: {found}"
        # Σ scheduled − Σ processed = in flight, per unprocessed step.
        assert self.sched.num_in_flight_tokens == sum(
            o.total_num_scheduled_tokens for o, _ in self.in_flight
        )

    def teardown(self) -> None:
        if self.sched is None or self.oracle.violations:
            return
        if self.reserve and self.settled and self.quarantine:  # the variants hunt hazards only
            self.drain()
        while self.in_flight:
            self.process()
        for req_id in list(self.s.requests):
            self.s.abort(req_id)
        check_scheduler(self.s)
        assert not self.s.requests
        kv = self.s.kv
        assert kv.pool.num_quarantined_refs == 0 and kv.num_free_blocks == kv.pool.num_blocks - 1

    def drain(self) -> None:
        """Engine steps, no arrival and no abort, until nothing is unfinished or in flight; fails
        when a request waits more than LIVENESS_BOUND steps for a token."""
        self.num_idle_steps = {rid: 0 for rid, r in self.s.requests.items() if not r.is_finished}
        while self.in_flight or self.s.has_unfinished_requests():
            self.engine_step()
            check_scheduler(self.s)
            for rid in list(self.num_idle_steps):
                request = self.s.requests.get(rid)
                if request is None or request.is_finished:
                    del self.num_idle_steps[rid]
                    continue
                self.num_idle_steps[rid] += 1
                assert self.num_idle_steps[rid] <= LIVENESS_BOUND, (
                    f"liveness: {rid} got no token in {LIVENESS_BOUND} steps "
                    f"({request.num_preemptions} preemptions)"
                )


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(stateful_step_count=100, deadline=None)


def _variant(settled: bool, quarantine: bool, direct_i4: bool) -> type[SchedulerMachine]:
    attrs = {"settled": settled, "quarantine": quarantine, "direct_i4": direct_i4}
    return type("UnprotectedMachine", (SchedulerMachine,), attrs)


@pytest.mark.parametrize(
    ("settled", "quarantine", "direct_i4", "expected"),
    [
        (False, False, True, r"I2|I4"),  # every protection off
        (True, False, True, r"I2"),  # immediate request-level frees: reuse while written
        (False, True, False, r"I4"),  # optimistic basis: a later step really reads a null block
    ],
)
def test_without_protections_the_machine_finds_a_violation(
    settled: bool, quarantine: bool, direct_i4: bool, expected: str
) -> None:
    with pytest.raises(AssertionError, match=expected):
        run_state_machine_as_test(
            _variant(settled, quarantine, direct_i4),
            settings=settings(
                max_examples=3000,
                stateful_step_count=100,
                deadline=None,
                phases=[Phase.generate, Phase.target],  # the failure itself is the result
                suppress_health_check=[HealthCheck.too_slow],
                print_blob=False,
            ),
        )


@pytest.mark.slow
def test_soak() -> None:
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(max_examples=3000, stateful_step_count=80, deadline=None),
    )
