"""Scheduler-wide invariant checks for tests and debug runs (ledger sums, queues, and I1, I4, I5 of
architecture.md §Invariants).

Reads state only; raises AssertionError naming the first broken invariant.
"""

from __future__ import annotations

from kvtier.kv.specs import Mamba, cdiv
from kvtier.sched.request import Request, RequestStatus, StepLedger
from kvtier.sched.scheduler import Scheduler

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KVS)


def check_ledger(request: Request, sched_step_seq: int, processed_step_seq: int) -> None:
    """Every derived counter equals its sum over the records; nothing is negative."""
    led: StepLedger = request.ledger
    rid = request.request_id
    records = list(led.records)
    live = [r for r in records if not r.stale]
    assert led.num_in_flight_tokens == sum(r.num_scheduled_tokens for r in records), rid
    assert led.num_scheduled_tokens - led.num_processed_tokens == led.num_in_flight_tokens, rid
    assert led.num_live_in_flight_tokens == sum(r.num_scheduled_tokens for r in live), rid
    assert led.num_draft_tokens == sum(r.num_draft_tokens for r in records), rid
    assert led.num_placeholders == sum(r.num_placeholders for r in live), rid
    assert led.num_pending_samples == sum(1 for r in live if r.num_placeholders), rid
    assert min(led.num_in_flight_tokens, led.num_live_in_flight_tokens, led.num_placeholders) >= 0
    seqs = [r.step_seq for r in records]
    assert seqs == sorted(set(seqs)), f"{rid}: ledger steps out of order {seqs}"
    assert all(processed_step_seq < s <= sched_step_seq for s in seqs), f"{rid}: {seqs}"
    for r in records:
        assert 0 <= r.num_draft_tokens < r.num_scheduled_tokens or r.num_draft_tokens == 0, rid
        assert r.num_placeholders in (0, 1 + r.num_draft_tokens), rid
    assert request.num_computed_tokens >= 0, f"{rid}: negative computed count"
    if request.is_finished:
        assert led.num_live_in_flight_tokens == 0, f"{rid}: finished with live records"
        return
    settled = request.num_settled_tokens
    assert 0 <= settled <= request.num_tokens, f"{rid}: settled {settled} vs {request.num_tokens}"


def check_scheduler(sched: Scheduler) -> None:
    """Assert every scheduler invariant and the KV manager's integrity (I1, I5)."""
    seq, processed = sched.sched_step_seq, sched.processed_step_seq
    assert 0 <= processed <= seq and seq - processed <= sched.async_depth
    total = 0
    for req_id, request in sched.requests.items():
        assert request.request_id == req_id
        check_ledger(request, seq, processed)
        total += request.num_in_flight_tokens
        if request.is_finished:
            assert request.ledger.records, f"{req_id}: finished and drained but still tracked"
    assert sched.num_in_flight_tokens == total >= 0, "global in-flight sum drifted"
    running = sched.running
    assert all(r.status is RequestStatus.RUNNING for r in running)
    assert len({id(r) for r in running}) == len(running) <= sched.max_num_seqs
    waiting = list(sched.waiting)
    assert all(r.status in _WAITING for r in waiting)
    live = {r.request_id for r in running} | {r.request_id for r in waiting}
    assert len(live) == len(running) + len(waiting)
    assert live == {k for k, r in sched.requests.items() if not r.is_finished}
    for request in running:
        assert sched.kv.has_request(request.request_id), f"{request.request_id} has no table"
        if sched.settled:
            check_pruned(sched, request)
    for req_id, request in sched.requests.items():
        if request.status is not RequestStatus.RUNNING:
            assert not sched.kv.has_request(req_id), f"{req_id} keeps blocks while not running"
    sched.kv.check_integrity()


def check_pruned(sched: Scheduler, request: Request) -> None:
    """No real block is left below what the settled count lets windows skip (architecture.md
    §Settled: pruning also runs right after each processed step)."""
    settled = request.num_settled_tokens
    tables = sched.kv.get_blocks(request.request_id)
    for g, (spec, table) in enumerate(zip(sched.kv.specs, tables, strict=True)):
        end = min(len(table), spec.num_skipped_tokens(settled) // spec.block_size)
        kept = [i for i in range(end) if not table[i].is_null]
        assert not kept, f"{request.request_id} group {g}: settled {settled}, unpruned {kept}"


def window_violations(sched: Scheduler) -> list[str]:
    """I4: for every running request, blocks in the window of any query ≥ settled are real."""
    found: list[str] = []
    for request in sched.running:
        settled = request.num_settled_tokens
        tables = sched.kv.get_blocks(request.request_id)
        for g, (spec, table) in enumerate(zip(sched.kv.specs, tables, strict=True)):
            if isinstance(spec, Mamba):
                continue
            bs = spec.block_size
            lo = spec.num_skipped_tokens(settled) // bs
            hi = min(len(table), cdiv(request.num_computed_tokens, bs))
            nulls = [i for i in range(lo, hi) if table[i].is_null]
            if nulls:
                found.append(f"{request.request_id} group {g}: settled {settled}, null {nulls}")
    return found
