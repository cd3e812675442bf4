"""architecture.md §Scenarios group C: async counters, the settled basis, placeholders, stale
outputs."""

from __future__ import annotations

import pytest

from kvtier.kv import ChunkedLocal, FullAttention, SlidingWindow
from kvtier.sched import RequestStatus
from tests.sched.factories import Driver, null_count, request, scheduler
from tests.sched.invariants import window_violations


def test_in_flight_accounting_async() -> None:  # scenario 20
    d = Driver(scheduler(depth=2))
    r = request("r", 100)
    d.sched.add_request(r)
    d.schedule()
    assert r.num_in_flight_tokens == 100
    d.schedule()
    assert r.num_in_flight_tokens == 101
    d.process(1)
    assert r.num_in_flight_tokens == 1
    d.process(2)
    assert r.num_in_flight_tokens == 0


def test_in_flight_accounting_sync() -> None:  # scenario 20
    d = Driver(scheduler(depth=1))
    r = request("r", 100)
    d.sched.add_request(r)
    d.schedule()
    assert r.num_in_flight_tokens == 100
    with pytest.raises(RuntimeError, match="update"):
        d.sched.schedule()
    d.process(1)
    assert r.num_in_flight_tokens == 0


@pytest.mark.parametrize(
    ("spec", "first_free"), [(SlidingWindow(16, 16), 5), (ChunkedLocal(16, 32), 6)]
)
def test_window_prune_waits_for_in_flight_step(spec: object, first_free: int) -> None:
    # scenarios 21 (SWA) and 23 (chunked local). Caching off: a fresh chunked-local request
    # would otherwise "hit" its invisible earlier chunks as null blocks and skip them.
    sched = scheduler(50, [spec], depth=2, budget=256, max_in_flight_tokens=0, caching=False)  # type: ignore[list-item]
    d = Driver(sched)
    d.sched.add_request(request("r", 100, max_tokens=10))
    d.schedule()
    free = d.sched.kv.num_free_blocks
    d.schedule()  # decode while the prefill is unprocessed
    assert null_count(d.sched, "r") == 0
    assert d.sched.kv.num_free_blocks == free
    d.process(1)
    d.schedule()
    assert null_count(d.sched, "r") == first_free
    assert d.sched.kv.num_free_blocks == free + first_free
    d.process(2)
    d.schedule()
    assert null_count(d.sched, "r") == first_free  # settled 101: nothing more, no double free
    d.sched.kv.check_integrity()


def test_window_prune_sync_control() -> None:  # scenario 22
    d = Driver(scheduler(50, [SlidingWindow(16, 16)], depth=1, budget=256, max_in_flight_tokens=0))
    d.sched.add_request(request("r", 100))
    d.schedule()
    d.process(1)
    d.schedule()
    assert null_count(d.sched, "r") == 5


def test_optimistic_basis_prunes_during_the_in_flight_step() -> None:  # scenario 21 regression
    d = Driver(
        scheduler(
            50, [SlidingWindow(16, 16)], depth=2, budget=256, max_in_flight_tokens=0, settled=False
        )
    )
    d.sched.add_request(request("r", 100))
    d.schedule()
    d.schedule()
    assert null_count(d.sched, "r") == 5  # the pre-fix signature


def _spec_rejection_setup(settled: bool) -> Driver:
    """Scenario 25: SWA W=8, bs 4, k=3; 40 committed tokens, blocks 0-7 null, 8 and 9 real."""
    sched = scheduler(
        60,
        [SlidingWindow(4, 8)],
        depth=2,
        budget=64,
        max_in_flight_tokens=0,
        num_speculative_tokens=3,
        settled=settled,
    )
    d = Driver(sched)
    d.sched.add_request(request("r", [1, 2, 3, 4] * 10, max_tokens=50, use_ngram=True))
    d.schedule()
    d.process(1, {"r": [1]})  # 41 tokens, the pattern continues: drafts 2, 3, 4
    return d


def test_spec_rejection_never_exposes_a_nulled_block() -> None:  # scenario 25
    d = _spec_rejection_setup(settled=True)
    r = d.sched.requests["r"]
    out = d.schedule()  # step N = 2
    assert out.scheduled_spec_decode_tokens["r"] == [2, 3, 4]
    assert r.num_computed_tokens == 44 and r.num_in_flight_tokens == 4
    assert null_count(d.sched, "r") == 8
    d.schedule()  # step N+1 before process(N)
    table = d.sched.kv.get_blocks("r")[0]
    assert not table[8].is_null  # settled 40 → 33 skipped tokens → 8 blocks
    assert window_violations(d.sched) == []
    d.process(2, {"r": [9]})  # 0 of 3 drafts accepted
    assert r.num_computed_tokens == 45 and r.num_in_flight_tokens == 4
    assert r.num_settled_tokens == 41 and r.num_tokens == 42
    assert not d.sched.kv.get_blocks("r")[0][8].is_null  # window of query 41 starts at 34
    assert window_violations(d.sched) == []


def test_optimistic_basis_nulls_the_block_a_rejection_needs() -> None:  # scenario 25, buggy
    d = _spec_rejection_setup(settled=False)
    d.schedule()
    d.schedule()
    assert d.sched.kv.get_blocks("r")[0][8].is_null
    assert window_violations(d.sched), "I4 must flag the optimistic basis"


def test_placeholders_with_drafts() -> None:  # scenario 26
    d = Driver(scheduler(depth=2, num_speculative_tokens=2))
    d.sched.add_request(request("r", [5, 6] * 20, max_tokens=20, use_ngram=True))
    d.schedule()
    d.process(1, {"r": [5]})
    r = d.sched.requests["r"]
    computed, in_flight = r.num_computed_tokens, r.num_in_flight_tokens
    assert r.num_output_placeholders == 0
    d.schedule()
    assert r.num_output_placeholders == 3 and r.num_in_flight_tokens == in_flight + 3
    d.process(2, {"r": [6, 8]})  # 1 accepted, 1 rejected
    assert r.num_computed_tokens == computed + 3 - 1
    assert r.num_output_placeholders == 0 and r.num_in_flight_tokens == in_flight
    assert r.output_token_ids == [5, 6, 8]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("depth", [2, 3])
def test_no_over_scheduling_by_length(max_tokens: int, depth: int) -> None:  # scenario 27
    d = Driver(scheduler(depth=depth))
    reqs = [request(f"r{i}", 20 + i, max_tokens=max_tokens) for i in range(2)]
    for r in reqs:
        d.sched.add_request(r)
    total = 0
    sched = d.sched
    for _ in range(100):
        if not sched.has_unfinished_requests() and not d.outputs:
            break
        if sched.can_schedule() and sched.has_unfinished_requests():
            total += d.schedule().total_num_scheduled_tokens
            if sched.can_schedule():
                continue
        d.process(min(d.outputs))
    assert total == sum(r.num_prompt_tokens + max_tokens - 1 for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [max_tokens, max_tokens]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert not sched.requests


def test_same_step_prefix_dedup() -> None:  # scenario 28
    d = Driver(scheduler(200, depth=2, budget=1000))
    prompt = list(range(100))
    reqs = [request(f"r{i}", list(prompt)) for i in range(5)]
    d.sched.add_request(reqs[0])
    d.sched.add_request(reqs[1])
    out = d.schedule()
    starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert starts["r0"] == 0 and starts["r1"] >= 96
    for r in reqs[2:]:
        d.sched.add_request(r)
    out = d.schedule()
    assert all(n.num_computed_tokens >= 96 for n in out.scheduled_new_reqs)
    assert len(out.scheduled_new_reqs) == 3


def test_multi_turn_hit() -> None:  # scenario 29
    d = Driver(scheduler(400, depth=2, budget=2048))
    reqs = [request(f"a{i}", 100, max_tokens=200) for i in range(5)]
    for r in reqs:
        d.sched.add_request(r)
    token = iter(range(10**6, 10**7))
    while d.sched.has_unfinished_requests() or d.outputs:
        if d.sched.can_schedule() and d.sched.has_unfinished_requests():
            d.schedule()
            if d.sched.can_schedule():
                continue
        step = min(d.outputs)
        d.process(step, {k: [next(token)] for k in d.outputs[step].num_scheduled_tokens})
    follow = [request(f"b{i}", list(r.all_token_ids)) for i, r in enumerate(reqs)]
    for r in follow:
        assert r.num_tokens == 300
        d.sched.add_request(r)
    out = d.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [288] * 5


def test_preemption_with_stale_output() -> None:  # scenario 30
    d = Driver(scheduler(5, depth=2, budget=256))  # 4 usable blocks
    a, r = request("a", 31, max_tokens=8), request("r", 30, max_tokens=8)
    d.sched.add_request(a)
    d.sched.add_request(r)
    d.schedule()  # both prefills: 2 + 2 blocks
    d.process(1)
    d.schedule()  # step 2: both decode inside their second blocks
    free = d.sched.kv.num_free_blocks
    r_blocks = [d.sched.kv.pool.blocks[i] for i in d.sched.kv.get_block_ids("r")[0]]
    out = d.schedule()  # step 3: a needs a third block; r is the latest, so the victim
    assert out.preempted_req_ids == ["r"]
    assert r.status is RequestStatus.PREEMPTED and d.sched.waiting.peek() is r
    # r's blocks are quarantined, so a still has none: it waits for its own step 2 to settle
    # rather than preempting itself, and nothing new is admitted meanwhile.
    assert out.num_scheduled_tokens == {} and a.status is RequestStatus.RUNNING
    assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0
    assert r.ledger.num_stale_tokens == 1 and r.num_in_flight_tokens == 1
    assert all(not t for t in d.sched.kv.get_block_ids("r"))
    assert d.sched.kv.num_free_blocks == free  # quarantined until step 2 is processed
    hashes_before = [b.block_hash for b in r_blocks]
    d.process(2, {"a": [11], "r": [12]})
    assert r.num_in_flight_tokens == 0 and r.ledger.num_stale_tokens == 0
    assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0
    assert r.output_token_ids == [7, 12]  # the stale token is delivered
    assert r.num_tokens == 32  # the stale token completes r's second block ...
    assert [b.block_hash for b in r_blocks] == hashes_before  # ... which is not cached
    assert d.sched.kv.num_free_blocks == free + 2


def test_preempted_request_waits_for_its_stale_step() -> None:
    d = Driver(scheduler(5, depth=2, budget=256))
    a, r = request("a", 31, max_tokens=3), request("r", 17, max_tokens=8)
    d.sched.add_request(a)
    d.sched.add_request(r)
    d.schedule()
    d.process(1)
    d.schedule()
    d.schedule()  # r preempted, step 2 still in flight
    d.process(2)
    d.run_until_idle()
    assert r.num_preemptions == 1
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8


def test_full_attention_is_never_pruned() -> None:
    d = Driver(scheduler(50, [FullAttention(16)], depth=2))
    d.sched.add_request(request("r", 100, max_tokens=4))
    d.run_until_idle()
    assert d.sched.kv.num_free_blocks == 49
