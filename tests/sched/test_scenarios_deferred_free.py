"""architecture.md §Scenarios group D: request-level frees wait in the quarantine for their fence
step."""

from __future__ import annotations

import pytest

from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import BlockPool, FullAttention, KVSpec, SlidingWindow
from kvtier.sched import RequestStatus, Scheduler, SchedulerOutput
from tests.sched.factories import Driver, request, scheduler
from tests.sched.invariants import check_scheduler
from tests.sched.oracle import AccessOracle


def _quarantined(d: Driver) -> int:
    return d.sched.kv.pool.num_quarantined_refs


@pytest.mark.parametrize("quarantine", [True, False])
def test_stop_while_over_scheduled_step_in_flight(quarantine: bool) -> None:  # 31, 32
    d = Driver(scheduler(20, depth=2, quarantine=quarantine))
    initial = d.sched.kv.num_free_blocks
    r = request("r", 33, max_tokens=10, stop_token_ids=(99,))
    d.sched.add_request(r)
    d.schedule()
    d.schedule()
    held = d.sched.kv.num_free_blocks
    d.process(1, {"r": [99]})
    assert r.status is RequestStatus.FINISHED_STOPPED
    if quarantine:  # gate on: held until the over-scheduled step 2 is processed
        assert _quarantined(d) == 3 and d.sched.kv.num_free_blocks == held
    else:  # gate off: freed at once
        assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == initial
    d.process(2)
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == initial
    assert not d.sched.requests


def test_no_step_in_flight_frees_immediately() -> None:  # 33
    d = Driver(scheduler(20, depth=2))
    initial = d.sched.kv.num_free_blocks
    d.sched.add_request(request("r", 33, stop_token_ids=(99,)))
    d.schedule()
    d.process(1, {"r": [99]})
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == initial


def test_abort_with_two_steps_in_flight() -> None:  # 34
    d = Driver(scheduler(20, depth=2))
    initial = d.sched.kv.num_free_blocks
    d.sched.add_request(request("r", 33))
    d.schedule()
    d.schedule()
    assert d.sched.abort("r")
    assert _quarantined(d) == 3
    d.process(1)
    assert _quarantined(d) == 3
    d.process(2)
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == initial
    assert not d.sched.abort("r")


def test_preemption_defers_the_free() -> None:  # 35
    d = Driver(scheduler(5, depth=3, budget=256))  # 4 usable blocks
    a, r = request("a", 31, max_tokens=6), request("r", 17, max_tokens=6)
    d.sched.add_request(a)
    d.sched.add_request(r)
    d.schedule()
    d.schedule()
    free = d.sched.kv.num_free_blocks
    out = d.schedule()  # a needs a third block: r is preempted with steps 1, 2 in flight
    assert out.preempted_req_ids == ["r"] and r.status is RequestStatus.PREEMPTED
    assert all(not t for t in d.sched.kv.get_block_ids("r"))
    assert d.sched.kv.num_free_blocks == free and _quarantined(d) == 2
    d.process(1)
    assert _quarantined(d) == 2
    d.process(2)
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == free + 2


def test_same_fence_several_requests() -> None:  # 36
    d = Driver(scheduler(20, depth=2))
    for name in ("x", "y"):
        d.sched.add_request(request(name, 33, stop_token_ids=(99,)))
    d.schedule()
    d.schedule()
    d.process(1, {"x": [99], "y": [99]})
    assert _quarantined(d) == 6
    d.process(2)
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == 19


def test_deep_pipeline_fence() -> None:  # 37
    d = Driver(scheduler(20, depth=3))
    d.sched.add_request(request("r", 33))
    for _ in range(3):
        d.schedule()
    assert d.sched.sched_step_seq == 3
    d.sched.abort("r")
    for step in (1, 2):
        d.process(step)
        assert _quarantined(d) == 3
    d.process(3)
    assert _quarantined(d) == 0


def test_per_request_fence() -> None:  # 38
    d = Driver(scheduler(20, depth=2))
    short, long = request("s", 33, max_tokens=1), request("l", 33, max_tokens=10)
    d.sched.add_request(short)
    d.sched.add_request(long)
    d.schedule()
    out = d.schedule()
    assert list(out.num_scheduled_tokens) == ["l"]
    d.process(1)
    assert short.status is RequestStatus.FINISHED_LENGTH
    assert d.sched.sched_step_seq > d.sched.processed_step_seq
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == 19 - 3


def test_abort_mid_prefill_chunk() -> None:  # 39
    d = Driver(scheduler(20, depth=2, long_prefill_token_threshold=16))
    r = request("r", 33)
    d.sched.add_request(r)
    out = d.schedule()
    assert out.num_scheduled_tokens == {"r": 16} and r.num_output_placeholders == 0
    d.sched.abort("r")
    assert _quarantined(d) == 1
    d.process(1)
    assert _quarantined(d) == 0 and d.sched.kv.num_free_blocks == 19


def test_sync_pipeline_abort_is_fenced() -> None:  # 40
    d = Driver(scheduler(20, depth=1))
    r = request("r", 33)
    d.sched.add_request(r)
    d.schedule()
    assert r.last_sched_seq == 1 > d.sched.processed_step_seq
    d.sched.abort("r")
    assert _quarantined(d) == 3
    d.process(1)
    assert _quarantined(d) == 0


def test_block_pool_fence() -> None:  # 41
    off = BlockPool(100, enable_quarantine=False)
    off.free(off.get_new_blocks(3), last_step_seq=5)
    assert off.num_free_blocks == 99 and off.num_quarantined_refs == 0
    pool = BlockPool(100)
    held = pool.get_new_blocks(2)
    pool.free(held, last_step_seq=5)
    assert pool.num_free_blocks == 97 and all(b.ref_cnt == 1 for b in held)
    pool.release_quarantine(4)
    assert pool.num_free_blocks == 97
    pool.release_quarantine(5)
    assert pool.num_free_blocks == 99 and all(b.ref_cnt == 0 for b in held)
    b3, b7 = pool.get_new_blocks(2)
    pool.free([b3], 7 + 0 * 3)
    pool.free([b7], 8)
    assert pool.release_quarantine(7) == 1 and b7.ref_cnt == 1
    assert pool.release_quarantine(8) == 1 and b7.ref_cnt == 0


class OracleDriver(Driver):
    """Driver whose steps also run on a fake runner with the access oracle (I2, I4)."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.oracle = AccessOracle(sched.kv.specs, sched.kv.get_block_ids)
        self.runner = FakeRunner(oracle=self.oracle)
        self.results = {}  # type: ignore[var-annotated]

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.results[out.step_seq] = self.runner.execute(out)
        return out

    def process(self, step: int, tokens: dict[str, list[int]] | None = None) -> None:
        out = self.outputs.pop(step)
        self.sched.update(out, self.results.pop(step))
        self.runner.on_processed(step)
        check_scheduler(self.sched)


def _hybrid(protect: bool) -> OracleDriver:
    specs: list[KVSpec] = [FullAttention(16), SlidingWindow(16, 16)]
    sched = scheduler(
        15, specs, depth=2, max_in_flight_tokens=0, quarantine=protect, settled=protect
    )
    return OracleDriver(sched)


def test_window_pruning_never_hands_out_a_block_being_read() -> None:  # 42
    d = _hybrid(protect=True)
    d.sched.add_request(request("a", 100, max_tokens=6))
    d.schedule()
    assert d.sched.kv.num_free_blocks == 0
    d.sched.add_request(request("q", 17, max_tokens=2))
    out = d.schedule()
    assert "q" not in out.num_scheduled_tokens
    d.process(1)
    swa_freed = set(range(1, 15)) - set(d.sched.kv.get_block_ids("a")[1])
    out = d.schedule()
    assert "q" in out.num_scheduled_tokens
    assert set().union(*d.sched.kv.get_block_ids("q")) <= swa_freed
    assert d.oracle.violations == []


def test_optimistic_unquarantined_pruning_races() -> None:  # 42, buggy basis
    d = _hybrid(protect=False)
    d.sched.add_request(request("a", 100, max_tokens=6))
    d.schedule()
    d.sched.add_request(request("q", 17, max_tokens=2))
    out = d.schedule()
    assert "q" in out.num_scheduled_tokens  # admitted onto blocks step 1 still reads
    assert d.oracle.violations and {v.invariant for v in d.oracle.violations} == {"I2"}


@pytest.mark.parametrize("quarantine", [True, False])
def test_request_free_never_hands_out_a_block_being_written(quarantine: bool) -> None:  # 43
    d = OracleDriver(scheduler(4, depth=2, quarantine=quarantine))  # 3 usable blocks
    d.sched.add_request(request("r", 33, max_tokens=1))
    d.schedule()
    d.sched.add_request(request("q", 17, max_tokens=1))
    d.sched.abort("r")
    out = d.schedule()
    if quarantine:
        assert "q" not in out.num_scheduled_tokens
        d.process(1)
        d.process(2)
        assert "q" in d.schedule().num_scheduled_tokens
        assert d.oracle.violations == []
    else:
        assert "q" in out.num_scheduled_tokens
        assert d.oracle.violations and {v.invariant for v in d.oracle.violations} == {"I2"}
