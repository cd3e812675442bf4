"""Request ledger, stop conditions, n-gram proposer, queues and boundary errors."""

from __future__ import annotations

import pytest

from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import FullAttention, IntegrityError, KVCacheManager, Mamba
from kvtier.sampling import StopConditions
from kvtier.sched import (
    NgramProposer,
    PriorityQueue,
    Request,
    RequestStatus,
    RunnerOutput,
    Scheduler,
    StepLedger,
    StepRecord,
    make_queue,
)
from tests.sched.factories import Driver, request, scheduler
from tests.sched.fake_engine import FakeEngine
from tests.torch_blocked import run_without_torch


def test_ledger_sums_follow_records_and_stale_marking() -> None:
    led = StepLedger()
    led.append(StepRecord(2, 10, 0, 0))
    led.append(StepRecord(3, 4, 3, 4))
    assert (led.num_in_flight_tokens, led.num_placeholders, led.num_pending_samples) == (14, 4, 1)
    assert led.consume(1) is None  # the request was not in step 1
    record = led.consume(2)
    assert record is not None and record.step_seq == 2
    led.mark_stale()
    assert led.num_in_flight_tokens == 4 and led.num_live_in_flight_tokens == 0
    assert led.num_placeholders == 0 and led.num_stale_tokens == 4
    with pytest.raises(IntegrityError, match="skipped"):
        led.consume(4)  # step 3 was never consumed: a real exception, `python -O` or not
    led.consume(3)
    assert led.num_scheduled_tokens == led.num_processed_tokens == 14
    assert led.num_in_flight_tokens == 0 and len(led) == 0


@pytest.mark.parametrize(
    ("sp", "tokens", "kept", "status"),
    [
        (StopConditions(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], RequestStatus.FINISHED_LENGTH),
        (StopConditions(eos_token_id=2), [5, 2, 7], [5, 2], RequestStatus.FINISHED_STOPPED),
        (StopConditions(eos_token_id=2, ignore_eos=True), [2, 2], [2, 2], None),
        (
            StopConditions(eos_token_id=2, min_tokens=2),
            [2, 2, 3],
            [2, 2],
            RequestStatus.FINISHED_STOPPED,
        ),
        (StopConditions(stop_token_ids=(9,)), [1, 9, 9], [1, 9], RequestStatus.FINISHED_STOPPED),
    ],
)
def test_deliver_stops_at_the_first_stop_condition(
    sp: StopConditions, tokens: list[int], kept: list[int], status: RequestStatus | None
) -> None:
    r = Request("r", [1, 1, 1], sp)
    assert r.deliver(tokens, max_model_len=100) == (status, kept)
    assert r.output_token_ids == kept


def test_deliver_stops_at_max_model_len() -> None:
    r = Request("r", [1] * 8, StopConditions(max_tokens=50))
    assert r.deliver([3, 3, 3], max_model_len=10) == (RequestStatus.FINISHED_LENGTH, [3, 3])
    assert r.num_tokens == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 3, "min_tokens": 4}, "min_tokens")],
)
def test_sampling_params_validation(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StopConditions(**kwargs)


def test_ngram_proposer() -> None:
    p = NgramProposer(3)
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # 2-gram [1, 2] matched at 0
    assert p.propose([1, 2, 3, 9, 2, 3]) == [9, 2, 3]  # 2-gram [2, 3] matched at 1
    assert p.propose([1, 2, 3]) == []
    assert p.propose([7, 7, 7, 7], k=2) == [7]  # latest earlier 3-gram: only one token after it
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)


def test_priority_queue_orders_and_picks_the_worst_victim() -> None:
    q = make_queue("priority")
    assert isinstance(q, PriorityQueue)
    reqs = [Request(f"r{i}", [1], priority=p, arrival_seq=i) for i, p in enumerate([2, 0, 1, 0])]
    for r in reqs:
        q.add(r)
    assert [r.request_id for r in q] == ["r1", "r3", "r2", "r0"]
    assert q.pop().request_id == "r1"
    q.prepend(reqs[1])
    assert q.peek().request_id == "r1"
    q.remove(reqs[2])
    assert len(q) == 3
    assert q.pick_victim(reqs) == 0  # among all running the worst rank is r0 (priority 2)
    assert q.pick_victim(reqs[1:]) == 1  # among r1..r3 it is r2 (priority 1)
    assert make_queue("fcfs").pick_victim(reqs) == 3  # FCFS: the latest
    with pytest.raises(ValueError, match="fcfs"):
        make_queue("lifo")


def test_priority_policy_preempts_the_lowest_priority_request() -> None:
    d = Driver(scheduler(5, depth=1, policy="priority"))  # 4 usable blocks
    low = Request("low", list(range(17)), StopConditions(max_tokens=20), priority=5)
    high = Request("high", list(range(100, 131)), StopConditions(max_tokens=20), priority=0)
    d.sched.add_request(low)
    d.sched.add_request(high)
    out = d.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["high", "low"]
    d.process(1)
    d.schedule()
    d.process(2)
    out = d.schedule()  # high needs a third block at position 32
    assert out.preempted_req_ids == ["low"] and "high" in out.num_scheduled_tokens


def test_abort_of_a_waiting_request() -> None:
    d = Driver(scheduler(3, depth=2))
    d.sched.add_request(request("a", 20, max_tokens=4))
    d.sched.add_request(request("b", 20, max_tokens=4))
    out = d.schedule()
    assert list(out.num_scheduled_tokens) == ["a"]  # b waits for blocks
    assert d.sched.abort("b")
    assert d.sched.requests["a"] and "b" not in d.sched.requests
    assert d.schedule().finished_req_ids == ["b"]


def test_stale_token_can_finish_a_preempted_request() -> None:
    d = Driver(scheduler(5, depth=2, budget=256))
    a = request("a", 31, max_tokens=8)
    # A stop token, not max_tokens: a request its steps in flight end by length is not
    # preempted (its blocks come back once they are processed; a waits for them).
    r = request("r", 17, max_tokens=8, stop_token_ids=(99,))
    d.sched.add_request(a)
    d.sched.add_request(r)
    d.schedule()
    d.process(1)
    d.schedule()
    out = d.schedule()
    assert out.preempted_req_ids == ["r"]
    d.process(2, {"r": [99]})  # r's stale token is a stop: it finishes while preempted
    assert r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 2
    assert r not in list(d.sched.waiting)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [(4096, 1, "max_model_len"), (200, 5000, "KV blocks")],
)
def test_add_request_rejects_what_can_never_run(prompt: int, max_tokens: int, match: str) -> None:
    sched = scheduler(10, max_model_len=4096)
    with pytest.raises(ValueError, match=match):
        sched.add_request(request("x", prompt, max_tokens=max_tokens))


def test_add_request_rejects_duplicates_and_reuse() -> None:
    sched = scheduler(100)
    r = request("x", 10)
    sched.add_request(r)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(request("x", 10))
    used = request("y", 10)
    used.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="fresh Request"):
        sched.add_request(used)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"async_depth": 4}, "async_depth"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": -1}, "long_prefill"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"policy": "random"}, "policy"),
    ],
)
def test_scheduler_arguments_are_validated(kwargs: dict[str, object], match: str) -> None:
    kv = KVCacheManager([FullAttention(16)], 10, max_model_len=256)
    with pytest.raises(ValueError, match=match):
        Scheduler(kv, **kwargs)  # type: ignore[arg-type]


def test_update_rejects_out_of_order_steps_and_bad_runner_outputs() -> None:
    sched = scheduler(100, depth=2)
    sched.add_request(request("r", 10))
    first = sched.schedule()
    second = sched.schedule()
    with pytest.raises(ValueError, match="process step 1"):
        sched.update(second, RunnerOutput(2, {}))
    with pytest.raises(ValueError, match="RunnerOutput of step 2"):
        sched.update(first, RunnerOutput(2, {}))
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.update(first, RunnerOutput(1, {}))


def test_from_config() -> None:
    from kvtier.config import SchedulerConfig

    kv = KVCacheManager([FullAttention(16)], 64, max_model_len=256)
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, async_depth=3)
    sched = Scheduler.from_config(cfg, kv)
    assert (sched.max_num_seqs, sched.async_depth) == (3, 3)
    for i in range(5):
        sched.add_request(request(f"r{i}", 30, max_tokens=5))
    FakeEngine(sched, FakeRunner()).run()
    assert sched.kv.num_free_blocks == 63


def test_sched_imports_without_torch() -> None:
    run_without_torch("import kvtier.sched, tests.sched.invariants, kvtier.bench.sched\n")


def test_protections_report_both_switches() -> None:
    assert scheduler(10).protections == {"settled": True, "quarantine": True}
    off = scheduler(10, settled=False, quarantine=False)
    assert off.protections == {"settled": False, "quarantine": False}


def test_mamba_snapshots_survive_the_decode_fast_path() -> None:
    """A step ending on a Mamba block boundary must reach the KV manager (it records the state
    snapshot there), even when the table needs no new block."""
    sched = scheduler(64, [Mamba(4)], depth=2, budget=64, max_in_flight_tokens=0)
    first = Request("a", list(range(10)), StopConditions(max_tokens=10))
    sched.add_request(first)
    FakeEngine(sched, FakeRunner()).run()
    follow = Request("b", list(first.all_token_ids), StopConditions(max_tokens=1))
    sched.add_request(follow)
    assert sched.kv.get_computed_blocks(follow)[1] == 16  # snapshot after 16 tokens
