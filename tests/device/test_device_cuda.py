"""The cuda backend on a real GPU (marked `gpu`): the store and load races of scenarios 62 and 63
(architecture.md §Scenarios) corrupt without the compute-done wait and never with it, as on the
sim."""

from __future__ import annotations

import pytest
import torch

from kvtier.device import COMPUTE, LOAD, STORE, AccessSet, KVLayout, OpMeta, make_device

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(num_layer_slots=1, block_size=8, num_kv_heads=4, head_dim=16)  # 4 KiB blocks
SLEEP_CYCLES = 5_000_000


def store_race(wait_for_compute: bool, iters: int = 30) -> int:
    dev = make_device("cuda", LAYOUT, 64, 64, sanitize="collect")
    blocks = list(range(64))
    corrupt = 0
    for i in range(1, iters + 1):
        dev.launch(COMPUTE, lambda: torch.cuda._sleep(SLEEP_CYCLES), AccessSet(), OpMeta("sleep"))
        dev.launch(
            COMPUTE,
            lambda i=i: dev.kv("device")[0].fill_(float(i)),
            AccessSet.of(writes={"device": blocks}),
            OpMeta("fill", step_seq=i),
        )
        if wait_for_compute:
            dev.wait(STORE, dev.record(COMPUTE))
        dev.copy_blocks(STORE, "device", "host", blocks, blocks, OpMeta("store", step_seq=i))
        dev.synchronize()
        corrupt += int(bool((dev.kv("host")[0] != i).any()))
    assert (dev.hazards != []) == (not wait_for_compute)
    return corrupt


def load_race(wait_for_compute: bool, iters: int = 30) -> int:
    dev = make_device("cuda", LAYOUT, 4, 4, sanitize="collect")
    probe = dev.alloc_buffer("probe", LAYOUT.page_shape(1)[1:])
    dev.kv("host")[0][2].fill_(2.0)
    torn = 0
    for i in range(iters):
        dev.launch(
            COMPUTE,
            lambda: dev.kv("device")[0][1].fill_(1.0),
            AccessSet.of(writes={"device": [1]}),
            OpMeta("fill-old", step_seq=i),
        )
        dev.launch(COMPUTE, lambda: torch.cuda._sleep(SLEEP_CYCLES), AccessSet(), OpMeta("sleep"))
        dev.launch(
            COMPUTE,
            lambda: probe.copy_(dev.kv("device")[0][1]),
            AccessSet.of(reads={"device": [1]}, writes={"probe": None}),
            OpMeta("probe"),
        )
        if wait_for_compute:
            dev.wait(LOAD, dev.record(COMPUTE))
        dev.copy_blocks(LOAD, "host", "device", [2], [1], OpMeta("load", step_seq=i))
        dev.synchronize()
        torn += int(bool((probe != 1.0).any()))
    return torn


def test_cuda_store_without_wait_corrupts_at_least_once() -> None:
    assert store_race(wait_for_compute=False) >= 1


def test_cuda_store_with_compute_done_wait_never_corrupts() -> None:
    assert store_race(wait_for_compute=True) == 0


def test_cuda_load_without_wait_tears_at_least_one_probe() -> None:
    assert load_race(wait_for_compute=False) >= 1


def test_cuda_load_with_compute_done_wait_never_tears() -> None:
    assert load_race(wait_for_compute=True) == 0


def test_cuda_host_tier_is_pinned_and_device_tier_on_gpu() -> None:
    dev = make_device("cuda", LAYOUT, 2, 2)
    assert dev.kv("host")[0].is_pinned() and dev.kv("device")[0].is_cuda
    assert dev.kv("device")[0].device == dev.torch_device
