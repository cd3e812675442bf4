"""The access oracle watches the host tier's copies too (issue 12 item 22): a load's destination
must not be a block an unprocessed step may still touch (I2), and a store must not read a block
an unprocessed step still writes (I1). Fake runs of the real scheduler with a `HostTier`; each
protection has a fast test that fails without it."""

from __future__ import annotations

from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import FullAttention, KVCacheManager
from kvtier.offload import HostTier
from kvtier.sampling import StopConditions
from kvtier.sched import Request, Scheduler
from tests.sched.fake_engine import FakeEngine
from tests.sched.oracle import AccessOracle


def _engine(quarantine: bool = True) -> tuple[Scheduler, FakeEngine, AccessOracle]:
    kv = KVCacheManager(
        [FullAttention(4)], 40, max_model_len=128, enable_quarantine=quarantine,
        max_in_flight_tokens=64,
    )  # fmt: skip
    sched = Scheduler(kv, max_num_batched_tokens=32, async_depth=2, tier=HostTier(kv, 40))
    oracle = AccessOracle(kv.specs, kv.get_block_ids)
    return sched, FakeEngine(sched, FakeRunner(oracle=oracle)), oracle


PREFIX = list(range(1, 17))


def _load_into_the_blocks_of_an_aborted_request(quarantine: bool) -> AccessOracle:
    """`p` stores a 16-token prefix on the host and leaves the device cache; `a` decodes; it is
    aborted while its step is in flight and `b`, sharing the prefix, loads it at once: its
    destinations are allocated where `a`'s blocks went (first, as fresh blocks)."""
    sched, engine, oracle = _engine(quarantine)
    sched.add_request(Request("p", [*PREFIX, 99], StopConditions(max_tokens=2)))
    engine.run()
    assert sched.kv.reset_prefix_cache()
    sched.add_request(Request("a", list(range(200, 214)), StopConditions(max_tokens=20)))
    for _ in range(6):
        engine.step()
    assert sched.num_unprocessed_steps > 0
    sched.abort("a")
    sched.add_request(Request("b", [*PREFIX, 77, 78], StopConditions(max_tokens=2)))
    engine.run()
    assert sched.tier is not None
    assert isinstance(sched.tier, HostTier) and sched.tier.metrics.num_loaded_blocks == 4
    return oracle


def test_the_oracle_sees_a_load_into_a_block_a_step_in_flight_reads() -> None:
    """Quarantine off: `a`'s blocks are free at once and `b`'s load lands in one that `a`'s
    step in flight still reads. The oracle reports it (it never looked at load destinations:
    `b` is parked while loading, and admitted later with those blocks counted as computed)."""
    oracle = _load_into_the_blocks_of_an_aborted_request(quarantine=False)
    assert [(v.invariant, v.req_id) for v in oracle.violations] == [("I2", "b")]


def test_the_quarantine_keeps_load_destinations_away_from_steps_in_flight() -> None:
    assert _load_into_the_blocks_of_an_aborted_request(quarantine=True).violations == []


def test_prefix_hits_are_not_stored_before_the_step_that_writes_them_is_processed() -> None:
    """`x`'s prefill (step 1) publishes its blocks when scheduled; `y`, sharing them, is admitted
    in step 2 with step 1 in flight. Its hit counts as settled at once, but step 1 still writes
    those blocks: no store of them may be planned before the admission step is processed (the
    guard in the store planner). The oracle checks every store source against pending writes."""
    sched, engine, oracle = _engine()
    sched.add_request(Request("x", [*PREFIX, *range(50, 58)], StopConditions(max_tokens=4)))
    engine.step()  # step 1: x's prefill, in flight
    sched.add_request(Request("y", [*PREFIX, *range(60, 66)], StopConditions(max_tokens=4)))
    engine.run()
    assert oracle.violations == []
    tier = sched.tier
    assert isinstance(tier, HostTier) and tier.metrics.num_stored_blocks >= 4
    assert sched.kv.stats.num_hit_tokens == 16  # y was admitted on x's blocks
