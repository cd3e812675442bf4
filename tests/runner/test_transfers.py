"""The worker half of the host tier on the sim device, architecture.md §Scenarios group G (62–66):
copies ordered after the forward by the compute-done event really are (data and sanitizer agree) and
without it they really race; one event per step orders both directions; a flush waits for every
transfer while polling never blocks; completions are reported once, as they land.

Scenario 67 (the end-to-end garble guard) is `kvtier bench garble` (tests/bench/test_garble.py).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.device import COMPUTE, LOAD, STORE, AccessSet, KVLayout, OpMeta, Work, make_device
from kvtier.device.sim import SimDevice
from kvtier.ids import EventId, StreamId
from kvtier.kv import FullAttention, KVCacheManager
from kvtier.offload import HostTier
from kvtier.runner.transfers import TransferEngine, TransferFaults
from kvtier.sched.output import PlannedTransfer
from kvtier.sched.request import Request, StepRecord

LAYOUT = KVLayout(num_layer_slots=2, block_size=4, num_kv_heads=1, head_dim=8)
SLOW = Work.fixed(5_000_000)  # a compute backlog far longer than a block copy


def device():
    return make_device("sim", LAYOUT, 16, 16, sanitize="collect")


def backlogged_forward_writing(dev, blocks: list[int], value: float, step: int) -> None:
    """A forward queued behind earlier compute work: it starts (and writes) late."""

    def write() -> None:
        for t in dev.kv("device"):
            t[blocks] = value

    dev.launch(COMPUTE, lambda: None, AccessSet.of(), OpMeta("backlog", step), SLOW)
    access = AccessSet.of(writes={"device": blocks})
    dev.launch(COMPUTE, write, access, OpMeta("forward", step))


ITERATIONS = 30


@pytest.mark.parametrize("ordered", [True, False])
def test_62_store_reads_each_block_after_the_forward_writes_it_only_with_the_event(
    ordered: bool,
) -> None:
    """64 blocks, 30 steps: a backlogged forward fills every block with the step number, then
    the step's stores copy them all to the host. Without the compute-done wait the control
    really corrupts (the race window is exercised); with it no step does."""
    dev = make_device("sim", LAYOUT, 64, 64, sanitize="collect")
    engine = TransferEngine(dev, order_after_compute=ordered)
    blocks = list(range(64))
    corrupted = 0
    for step in range(1, ITERATIONS + 1):
        backlogged_forward_writing(dev, blocks, float(step), step)
        engine.forward_launched()
        engine.launch_stores([PlannedTransfer(step, "r", blocks, blocks, is_load=False)], step)
        dev.synchronize()
        assert engine.poll() == ([step], [])
        corrupted += any(bool((t != step).any()) for t in dev.kv("host"))
    if ordered:
        assert corrupted == 0 and dev.sanitizer.num_hazards == 0
    else:
        assert corrupted >= 1 and {h.kind for h in dev.hazards} == {"RAW"}


@pytest.mark.parametrize("ordered", [True, False])
def test_63_load_cannot_overwrite_a_block_a_pending_forward_reads_with_the_event(
    ordered: bool,
) -> None:
    """30 steps: a forward fills block 3 with "old", is backlogged, then copies it to a probe;
    the next step's load brings "new" into block 3 for its next owner. Without the wait the
    probe sees "new" (torn read); with it, never."""
    dev = device()
    engine = TransferEngine(dev, order_after_compute=ordered)
    for t in dev.kv("host"):
        t[6].fill_(9.0)  # what the load brings in for the block's next owner
    probe = dev.alloc_buffer("probe", (LAYOUT.block_size,))
    torn = 0
    for step in range(1, ITERATIONS + 1):

        def fill_old() -> None:
            for t in dev.kv("device"):
                t[3].fill_(1.0)

        def read() -> None:
            probe.copy_(dev.kv("device")[0].view(LAYOUT.slot_shape(16))[3][0, :, 0, 0])

        dev.launch(COMPUTE, fill_old, AccessSet.of(writes={"device": [3]}), OpMeta("fill", step))
        dev.launch(COMPUTE, lambda: None, AccessSet.of(), OpMeta("backlog", step), SLOW)
        access = AccessSet.of(reads={"device": [3]}, writes={"probe": None})
        dev.launch(COMPUTE, read, access, OpMeta("forward", step))
        engine.forward_launched()
        engine.launch_loads([PlannedTransfer(step, "q", [6], [3], is_load=True)], step + 1)
        dev.synchronize()
        assert engine.poll() == ([step], [])
        dev.host_op(lambda: None, AccessSet.of(reads={"probe": None}), OpMeta("check", step))
        torn += int(bool((probe != 1.0).any()))
    if ordered:
        assert torn == 0 and dev.sanitizer.num_hazards == 0
    else:
        assert torn >= 1 and "WAR" in {h.kind for h in dev.hazards}


def test_64_one_compute_done_event_per_step_orders_loads_and_stores() -> None:
    """A step with one load pair and one store pair: both copies wait on the same event object,
    recorded once per step after the forward. The load waits on the record current at its
    launch (the previous step's forward: it precedes this step's forward, which never reads
    it — its request waits for the load to complete); the store on this step's forward."""
    dev = device()
    assert isinstance(dev, SimDevice)
    engine = TransferEngine(dev)
    waits: list[tuple[int, EventId]] = []
    records: list[tuple[int, EventId]] = []
    wait, record = dev.wait, dev.record

    def spy_wait(stream: StreamId, event: EventId) -> None:
        waits.append((stream, event))
        wait(stream, event)

    def spy_record(stream: StreamId, event: EventId | None = None) -> EventId:
        ev = record(stream, event)
        records.append((stream, ev))
        return ev

    dev.wait = spy_wait  # type: ignore[method-assign]
    dev.record = spy_record  # type: ignore[method-assign]
    backlogged_forward_writing(dev, [2], 1.0, 1)  # step 1
    engine.forward_launched()
    assert records == [(COMPUTE, engine.compute_done)]
    records.clear()
    engine.launch_loads([PlannedTransfer(1, "q", [6], [5], is_load=True)], 2)  # step 2
    backlogged_forward_writing(dev, [4], 2.0, 2)
    engine.forward_launched()
    engine.launch_stores([PlannedTransfer(2, "r", [4], [7], is_load=False)], 2)
    assert waits == [(LOAD, engine.compute_done), (STORE, engine.compute_done)]
    assert [r for r in records if r[1] == engine.compute_done] == [(COMPUTE, engine.compute_done)]
    dev.synchronize()
    spans = {(e.label, e.step_seq): e for e in dev.trace}
    assert spans["load", 2].start_ns >= spans["forward", 1].end_ns
    assert spans["store", 2].start_ns >= spans["forward", 2].end_ns
    assert dev.sanitizer.num_hazards == 0


def test_64_without_the_event_protection_no_copy_waits() -> None:
    dev = device()
    engine = TransferEngine(dev, order_after_compute=False)
    waits: list[EventId] = []
    wait = dev.wait
    dev.wait = lambda stream, event: (waits.append(event), wait(stream, event))[1]  # type: ignore[method-assign,func-returns-value]
    backlogged_forward_writing(dev, [2], 1.0, 1)
    engine.forward_launched()
    engine.launch_loads([PlannedTransfer(1, "q", [6], [5], is_load=True)], 2)
    engine.launch_stores([PlannedTransfer(2, "r", [2], [7], is_load=False)], 2)
    assert waits == []


def test_65_flush_waits_for_every_transfer_in_flight_and_poll_never_blocks() -> None:
    """Preemption flush, the worker half: loads and stores queued behind a compute backlog;
    polling reports nothing and leaves the host clock where it was (nothing blocks); `flush`
    synchronises every outstanding copy of both directions and reports them all."""
    dev = device()
    assert isinstance(dev, SimDevice)
    engine = TransferEngine(dev)
    backlogged_forward_writing(dev, [1, 2], 4.0, 1)
    engine.forward_launched()
    engine.launch_stores([PlannedTransfer(1, "p", [1, 2], [3, 4], is_load=False)], 1)
    engine.launch_loads([PlannedTransfer(2, "q", [9], [8], is_load=True)], 2)
    engine.launch_loads([PlannedTransfer(3, "q2", [10], [11], is_load=True)], 2)
    before = dev.now_ns
    assert engine.poll() == ([], [])
    assert dev.now_ns - before < 100_000  # a few event queries, not the 5 ms backlog
    ends = max(e.end_ns for e in dev.trace if e.label in ("load", "store"))
    assert sorted(engine.flush()[0]) == [1, 2, 3]
    assert engine.num_pending == 0 and dev.now_ns >= ends
    assert bool((dev.kv("host")[0][3] == 4.0).all())  # the preempted request's copy landed
    assert engine.poll() == ([], []) and dev.sanitizer.num_hazards == 0


def test_65_a_preempted_request_keeps_its_stored_blocks_pinned_until_the_copy_completes() -> None:
    """Preemption flush, the scheduler half. kvtier needs no blocking flush on preemption: the
    stores planned for a preempted request pin their device blocks, so freeing the request
    cannot hand them to a new owner until the copy completes (vLLM synchronises instead)."""
    dev = KVCacheManager([FullAttention(16)], 16, max_model_len=4096)
    tier = HostTier(dev, 8)
    req = Request("P", list(range(1000, 1033)), hasher=dev.hasher)
    hits, num_hit = dev.get_computed_blocks(req)
    assert (
        dev.allocate_slots(
            req, req.num_tokens - num_hit, num_new_computed_tokens=num_hit, new_computed_blocks=hits
        )
        is not None
    )
    req.num_computed_tokens = req.num_tokens
    req.ledger.append(StepRecord(1, req.num_tokens, 0, 1))
    assert tier.plan_stores([req]) == []  # its step is in flight: nothing settled yet
    req.ledger.consume(1)  # processed; then preempted before the next plan_stores
    [store] = tier.preempt_request(req)  # before its blocks are freed, as the scheduler does
    assert len(store.src_block_ids) == 2
    dev.free("P")
    assert set(store.src_block_ids).isdisjoint(dev.pool.free_queue.block_ids())
    dev.check_integrity(num_pinned=tier.device_pins())
    tier.complete([store.transfer_id])
    assert set(store.src_block_ids) <= set(dev.pool.free_queue.block_ids())
    assert not tier.device_pins()
    tier.check_integrity()


def test_66_completions_are_reported_as_they_land_the_rest_in_a_later_poll() -> None:
    """Loads 0, 1, 2 launched; only 0 and 1 have completed: the poll reports those two; 2 is
    reported by a later poll once it lands (the id → request map is the host tier's, which
    keeps every load until it completes: tests/offload `complete`)."""
    dev = device()
    engine = TransferEngine(dev)
    engine.launch_loads([PlannedTransfer(0, "a", [1], [1], is_load=True)], 1)
    engine.launch_loads([PlannedTransfer(1, "b", [2], [2], is_load=True)], 1)
    first_two = dev.record(LOAD)
    dev.launch(LOAD, lambda: None, AccessSet.of(), OpMeta("slow-copy", 1), SLOW)
    engine.launch_loads([PlannedTransfer(2, "c", [3], [3], is_load=True)], 1)
    dev.synchronize_event(first_two)
    assert engine.poll() == ([0, 1], [])
    assert engine.poll() == ([], []) and engine.num_pending == 1
    dev.synchronize()
    assert engine.poll() == ([2], [])
    assert engine.num_pending == 0


def test_completions_are_polled_without_blocking_and_reported_once() -> None:
    dev = device()
    engine = TransferEngine(dev)
    backlogged_forward_writing(dev, [2], 3.0, 1)
    engine.forward_launched()
    engine.launch_stores([PlannedTransfer(10, "r", [2], [4], is_load=False)], step_seq=1)
    engine.set_faults(TransferFaults(fail_transfer_ids=frozenset({11})))
    engine.launch_loads([PlannedTransfer(11, "s", [7], [8], is_load=True)], step_seq=1)
    assert engine.poll() == ([], [])  # nothing has finished yet in virtual time
    assert engine.num_pending == 2
    dev.synchronize()
    assert engine.poll() == ([10], [11])
    assert engine.poll() == ([], []) and engine.num_pending == 0
    assert torch.equal(dev.kv("host")[1][4], torch.full_like(dev.kv("host")[1][4], 3.0))


def test_a_transfer_id_in_flight_cannot_be_reused() -> None:
    dev = device()
    engine = TransferEngine(dev)
    t = PlannedTransfer(1, "r", [1], [1], is_load=True)
    engine.launch_loads([t], step_seq=1)
    with pytest.raises(ValueError, match="transfer id 1 is already in flight"):
        engine.launch_loads([t], step_seq=2)
    assert engine.flush() == ([1], [])


# ---- fault injection (`TransferFaults`) ---------------------------------------------------------


def _load(tid: int, src: int, dst: int) -> PlannedTransfer:
    return PlannedTransfer(tid, f"r{tid}", [src], [dst], is_load=True)


def test_faults_fail_every_nth_load_and_given_ids() -> None:
    dev = device()
    engine = TransferEngine(dev)
    engine.set_faults(TransferFaults(fail_loads_every=2, fail_transfer_ids=frozenset({5})))
    engine.launch_loads([_load(i, i, i) for i in range(1, 5)], step_seq=1)
    engine.launch_stores([PlannedTransfer(5, "s", [9], [9], is_load=False)], step_seq=1)
    assert engine.flush() == ([1, 3], [2, 4, 5])


def test_a_corrupted_store_fails_every_load_of_its_host_blocks_until_rewritten() -> None:
    dev = device()
    engine = TransferEngine(dev)
    engine.set_faults(TransferFaults(corrupt_stores=1))
    engine.launch_stores([PlannedTransfer(1, "a", [2, 3], [4, 5], is_load=False)], step_seq=1)
    assert engine.flush() == ([1], [])  # the store itself reports success
    engine.launch_loads([_load(2, 4, 6), _load(3, 7, 8)], step_seq=2)
    assert engine.flush() == ([3], [2])
    engine.launch_loads([_load(4, 5, 6)], step_seq=3)  # persistently bad: fails again
    assert engine.flush() == ([], [4])
    engine.launch_stores([PlannedTransfer(5, "b", [2], [4], is_load=False)], step_seq=4)
    engine.launch_loads([_load(6, 4, 6), _load(7, 5, 7)], step_seq=4)  # 4 rewritten, 5 not
    assert engine.flush() == ([5, 6], [7])
    engine.set_faults(TransferFaults())  # forgets the bad copies
    engine.launch_loads([_load(8, 5, 7)], step_seq=5)
    assert engine.flush() == ([8], [])


def test_slow_copies_are_reported_delay_polls_late() -> None:
    dev = device()
    engine = TransferEngine(dev)
    engine.set_faults(TransferFaults(delay_polls=2))
    engine.launch_loads([_load(1, 1, 1)], step_seq=1)
    dev.synchronize()
    assert engine.poll() == ([], [])  # completed, seen, held back
    assert engine.poll() == ([], []) and engine.num_pending == 1
    assert engine.poll() == ([1], [])
    assert engine.num_pending == 0


@pytest.mark.parametrize("field", ["fail_loads_every", "corrupt_stores", "delay_polls"])
def test_bad_fault_settings_name_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"TransferFaults.{field} must be an int ≥ 0"):
        TransferFaults(**{field: -1})  # type: ignore[arg-type]
