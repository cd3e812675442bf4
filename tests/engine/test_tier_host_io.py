"""`runner/host_io.py` `HostBlockIO`: host blocks as bytes for the tiers below the host, round
trip exact, and each read or write a declared host op the sanitizer checks against the copies
(architecture.md §Chain): demoting a block a store copy is still writing, or staging into one a
load copy still reads, is a reported race; after the copy's stream is synchronized it is not."""

from __future__ import annotations

import pytest
import torch

from kvtier.device import LOAD, STORE, KVLayout, OpMeta, RaceError, make_device
from kvtier.device.base import Device
from kvtier.ids import BlockId
from kvtier.runner.host_io import HostBlockIO

LAYOUT = KVLayout(num_layer_slots=2, block_size=4, num_kv_heads=1, head_dim=4)


def sim() -> Device:
    return make_device("sim", LAYOUT, 8, 8, sanitize="raise")


def test_round_trip_is_exact_and_sized_by_every_layer_slot() -> None:
    dev = sim()
    io = HostBlockIO(dev)
    host = dev.kv("host")
    assert io.block_bytes == sum(t[0].numel() * t.element_size() for t in host)
    for i, t in enumerate(host):
        t[2].copy_(torch.arange(t[2].numel(), dtype=t.dtype).view_as(t[2]) + 100 * i)
    (payload,) = io.read([BlockId(2)])
    io.write([BlockId(5)], [payload])
    for t in host:
        assert torch.equal(t[5], t[2])
    with pytest.raises(ValueError, match="bytes"):
        io.write([BlockId(5)], [payload[:-1]])
    dev.close()


def test_demoting_a_block_a_store_copy_still_writes_is_a_race() -> None:
    dev = sim()
    io = HostBlockIO(dev)
    dev.copy_blocks(STORE, "device", "host", [BlockId(1)], [BlockId(3)], OpMeta("store"))
    with pytest.raises(RaceError):
        io.read([BlockId(3)])
    dev.close()


def test_staging_into_a_block_a_load_copy_still_reads_is_a_race() -> None:
    dev = sim()
    io = HostBlockIO(dev)
    dev.copy_blocks(LOAD, "host", "device", [BlockId(4)], [BlockId(1)], OpMeta("load"))
    with pytest.raises(RaceError):
        io.write([BlockId(4)], [bytes(io.block_bytes)])
    dev.close()


def test_after_the_copy_completes_the_host_op_is_ordered() -> None:
    dev = sim()
    io = HostBlockIO(dev)
    dev.copy_blocks(STORE, "device", "host", [BlockId(1)], [BlockId(3)], OpMeta("store"))
    dev.synchronize_stream(STORE)
    io.read([BlockId(3)])
    assert dev.sanitizer is not None and dev.sanitizer.num_hazards == 0
    dev.close()
