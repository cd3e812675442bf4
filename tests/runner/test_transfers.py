"""The worker half of the host tier on the sim device: copies ordered after the forward by the
compute-done event really are (data and sanitizer agree), and without it they really race."""

from __future__ import annotations

import pytest
import torch

from kvtier.device import COMPUTE, AccessSet, KVLayout, OpMeta, Work, make_device
from kvtier.runner.transfers import TransferEngine
from kvtier.sched.output import PlannedTransfer

LAYOUT = KVLayout(num_layer_slots=2, block_size=4, num_kv_heads=1, head_dim=8)
SLOW = Work.fixed(5_000_000)  # a compute backlog far longer than a block copy


def device():
    return make_device("sim", LAYOUT, 16, 16, sanitize="collect")


def backlogged_forward_writing(dev, block: int, value: float) -> None:
    """A forward queued behind earlier compute work: it starts (and writes) late."""

    def write() -> None:
        for t in dev.kv("device"):
            t[block].fill_(value)

    dev.launch(COMPUTE, lambda: None, AccessSet.of(), OpMeta("backlog", 1), SLOW)
    dev.launch(COMPUTE, write, AccessSet.of(writes={"device": [block]}), OpMeta("forward", 1))


@pytest.mark.parametrize("ordered", [True, False])
def test_store_reads_the_block_after_the_forward_writes_it_only_with_the_event(
    ordered: bool,
) -> None:
    dev = device()
    engine = TransferEngine(dev, order_after_compute=ordered)
    backlogged_forward_writing(dev, 3, 7.0)
    engine.forward_launched()
    engine.launch_stores([PlannedTransfer(1, "r", [3], [5], is_load=False)], step_seq=1)
    dev.synchronize()
    stored = dev.kv("host")[0][5]
    assert bool((stored == 7.0).all()) is ordered  # unordered: the copy ran before the write
    assert (dev.sanitizer.num_hazards == 0) is ordered
    if not ordered:
        assert {h.kind for h in dev.hazards} == {"RAW"}


@pytest.mark.parametrize("ordered", [True, False])
def test_load_cannot_overwrite_a_block_a_pending_forward_reads_with_the_event(
    ordered: bool,
) -> None:
    dev = device()
    engine = TransferEngine(dev, order_after_compute=ordered)
    for t in dev.kv("device"):
        t[3].fill_(1.0)  # what the pending forward must read
    for t in dev.kv("host"):
        t[6].fill_(9.0)  # what the load brings in for the block's next owner
    probe = dev.alloc_buffer("probe", (LAYOUT.block_size,))

    def read() -> None:
        probe.copy_(dev.kv("device")[0][3][0, :, 0, 0])

    access = AccessSet.of(reads={"device": [3]}, writes={"probe": None})
    dev.launch(COMPUTE, lambda: None, AccessSet.of(), OpMeta("backlog", 1), SLOW)
    dev.launch(COMPUTE, read, access, OpMeta("forward", 1))
    engine.forward_launched()
    engine.launch_loads([PlannedTransfer(2, "q", [6], [3], is_load=True)], step_seq=2)
    dev.synchronize()
    assert bool((probe == 1.0).all()) is ordered  # unordered: the forward read the new data
    assert (dev.sanitizer.num_hazards == 0) is ordered
    if not ordered:
        assert {h.kind for h in dev.hazards} == {"WAR"}


def test_completions_are_polled_without_blocking_and_reported_once() -> None:
    dev = device()
    engine = TransferEngine(dev)
    backlogged_forward_writing(dev, 2, 3.0)
    engine.forward_launched()
    engine.launch_stores([PlannedTransfer(10, "r", [2], [4], is_load=False)], step_seq=1)
    engine.launch_loads([PlannedTransfer(11, "s", [7], [8], is_load=True)], step_seq=1)
    engine.fail_ids.add(11)
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
