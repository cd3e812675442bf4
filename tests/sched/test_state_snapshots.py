"""State snapshots are marked on verified ends (architecture.md §Rollback): a Mamba group's block
is a prefix-cache snapshot only if the device's count after some processed step ended exactly at
the block's end. A scheduled end that a rejected draft never reached publishes nothing."""

from __future__ import annotations

from kvtier.kv import FullAttention, Mamba
from kvtier.sampling import StopConditions
from kvtier.sched import Request
from tests.sched.factories import Driver, scheduler

SPECS = [FullAttention(4), Mamba(4)]


def _published(driver: Driver, request: Request, group: int) -> list[int]:
    """Positions of the request's blocks that group `group` holds as prefix-cache entries."""
    kv = driver.sched.kv
    return [
        i for i, h in enumerate(request.block_hashes) if kv.get_cached_block(group, h) is not None
    ]


def test_a_draft_step_scheduled_to_a_boundary_but_rolled_back_publishes_no_snapshot() -> None:
    # 6 prompt tokens; a step of 1 token + 1 draft ends (as scheduled) at 8, the draft is
    # rejected (the device holds 7), the next step runs 7 → 9. No step ever ended at 8, so the
    # state page of position 1 holds the state after 7 tokens: it must not be a prefix hit.
    sched = scheduler(32, SPECS, depth=1, budget=8, num_speculative_tokens=1)
    request = Request("r", [1, 2, 3, 1, 2, 3], StopConditions(max_tokens=8, use_ngram=True))
    sched.add_request(request)
    driver = Driver(sched)
    assert driver.schedule().num_scheduled_tokens == {"r": 4}  # chunks end on boundaries
    driver.process(1)
    assert driver.schedule().num_scheduled_tokens == {"r": 2}
    driver.process(2, {"r": [1]})  # 6 computed; tokens 1 2 3 1 2 3 1
    out = driver.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [2]}  # positions 6, 7: ends at 8
    driver.process(3, {"r": [3]})  # draft 2 rejected: 7 computed
    assert request.num_computed_tokens == 7
    out = driver.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [1]}  # positions 7, 8: ends at 9
    driver.process(4, {"r": [1, 7]})  # draft accepted: 9 computed, verified
    assert request.num_computed_tokens == 9
    assert _published(driver, request, 0) == [0, 1]
    assert _published(driver, request, 1) == [0], "a snapshot no step ended at was published"


def test_a_step_ending_on_a_boundary_publishes_its_snapshot_once_processed() -> None:
    """And prefill chunks end on state-block boundaries (architecture.md §Snapshots)."""
    sched = scheduler(32, SPECS, depth=2, budget=6)
    request = Request("r", list(range(10, 20)), StopConditions(max_tokens=4))
    sched.add_request(request)
    driver = Driver(sched)
    assert driver.schedule().num_scheduled_tokens == {"r": 4}  # prefill chunk 0..4
    driver.schedule()  # prefill chunk 4..8, scheduled before the first is processed
    assert _published(driver, request, 1) == []  # nothing verified yet
    driver.process(1)
    assert _published(driver, request, 1) == [0]  # the device holds exactly 4 tokens
    driver.process(2)
    assert _published(driver, request, 1) == [0, 1]
    driver.run_until_idle()
