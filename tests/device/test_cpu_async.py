"""The cpu backend runs each stream on its own worker thread: ops leave the host at once, streams
overlap unless an event orders them, failures are sticky. Gates (threading.Event) hold ops in
place, so every test is deterministic: nothing here depends on timing."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from kvtier.device import (
    COMPUTE,
    LOAD,
    STORE,
    AccessSet,
    DeviceError,
    KVLayout,
    OpMeta,
    make_device,
)
from kvtier.device.cpu import CpuDevice

LAYOUT = KVLayout(num_layer_slots=2, block_size=4, num_kv_heads=1, head_dim=4)
NOTHING = AccessSet()


def cpu(**kw: object) -> CpuDevice:
    dev = make_device("cpu", LAYOUT, 4, 4, sanitize=None, **kw)  # type: ignore[arg-type]
    assert isinstance(dev, CpuDevice)
    return dev


def gated(dev: CpuDevice, stream: int = COMPUTE) -> threading.Event:
    """Launch an op on `stream` that blocks its worker until the returned gate opens."""
    gate = threading.Event()
    dev.launch(stream, gate.wait, NOTHING, OpMeta("gate"))  # type: ignore[arg-type]
    return gate


def test_ops_run_off_the_host_thread_in_launch_order() -> None:
    dev = cpu()
    seen: list[tuple[int, str]] = []
    gate = gated(dev)
    for i in range(5):
        dev.launch(
            COMPUTE,
            lambda i=i: seen.append((i, threading.current_thread().name)),  # type: ignore[misc]
            NOTHING,
            OpMeta("op"),
        )
    assert seen == []  # launch returned while the worker is held at the gate
    gate.set()
    dev.synchronize()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert all(name != threading.current_thread().name for _, name in seen)
    dev.close()


def test_a_pending_event_queries_false_and_completes_when_its_stream_gets_there() -> None:
    dev = cpu()
    gate = gated(dev)
    done = dev.record(COMPUTE)
    assert dev.query(done) is False
    gate.set()
    dev.synchronize_event(done)
    assert dev.query(done) is True
    dev.close()


def test_an_unordered_load_really_overwrites_a_block_before_a_pending_forward_reads_it() -> None:
    """Without the compute-done event the race is physical: the load lands first."""
    dev = cpu()
    kv = dev.kv("device")[0]
    host = dev.kv("host")[0]
    kv[1].fill_(1.0)
    host[0].fill_(9.0)
    gate = gated(dev)  # the forward's stream is backlogged
    read: list[float] = []
    dev.launch(COMPUTE, lambda: read.append(float(kv[1].mean())), NOTHING, OpMeta("forward"))
    dev.copy_blocks(LOAD, "host", "device", [0], [1], OpMeta("load"))
    dev.synchronize_stream(LOAD)  # the load finished while the forward is still queued
    gate.set()
    dev.synchronize()
    assert read == [9.0]  # the forward read the loaded data, not its own block
    dev.close()


def test_a_load_waiting_on_the_compute_done_event_lands_after_the_forward() -> None:
    dev = cpu()
    kv = dev.kv("device")[0]
    host = dev.kv("host")[0]
    kv[1].fill_(1.0)
    host[0].fill_(9.0)
    gate = gated(dev)
    read: list[float] = []
    dev.launch(COMPUTE, lambda: read.append(float(kv[1].mean())), NOTHING, OpMeta("forward"))
    dev.wait(LOAD, dev.record(COMPUTE))
    dev.copy_blocks(LOAD, "host", "device", [0], [1], OpMeta("load"))
    loaded = dev.record(LOAD)
    assert dev.query(loaded) is False  # held behind the forward, which is held at the gate
    gate.set()
    dev.synchronize()
    assert read == [1.0] and float(kv[1].mean()) == 9.0
    dev.close()


def test_streams_overlap_a_store_copy_runs_while_the_forward_is_busy() -> None:
    dev = cpu()
    dev.kv("device")[0][2].fill_(5.0)
    gate = gated(dev)
    dev.copy_blocks(STORE, "device", "host", [2], [3], OpMeta("store"))
    dev.synchronize_stream(STORE)  # would hang if streams were one queue
    assert float(dev.kv("host")[0][3].mean()) == 5.0
    gate.set()
    dev.close()


def test_a_failed_op_is_a_sticky_device_error_that_names_it_and_hangs_no_one() -> None:
    dev = cpu()
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("kernel exploded")

    dev.launch(COMPUTE, boom, NOTHING, OpMeta("forward", step_seq=7))
    dev.launch(COMPUTE, lambda: ran.append(1), NOTHING, OpMeta("after"))
    done = dev.record(COMPUTE)
    with pytest.raises(DeviceError, match=r"forward .*step 7.*kernel exploded"):
        dev.synchronize_event(done)
    assert ran == []  # nothing runs on state a failed op may have half-written
    for call in (lambda: dev.query(done), dev.synchronize, lambda: gated(dev)):
        with pytest.raises(DeviceError):
            call()
    dev.close()


def test_host_ops_run_on_the_host_thread() -> None:
    dev = cpu()
    names: list[str] = []
    dev.host_op(lambda: names.append(threading.current_thread().name), NOTHING, OpMeta("read"))
    assert names == [threading.current_thread().name]
    dev.close()


def test_close_stops_the_stream_workers_after_launched_work() -> None:
    dev = cpu()
    out = torch.zeros(1)
    dev.launch(COMPUTE, lambda: out.fill_(3.0), NOTHING, OpMeta("op"))
    workers = [t for t in threading.enumerate() if t.name.startswith("kvtier-cpu-stream")]
    assert len(workers) >= 3
    threads = dev.stream_threads()
    dev.close()
    dev.close()  # idempotent
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert float(out) == 3.0


EXIT_WITH_OP_RUNNING = """
import torch
from kvtier.device import COMPUTE, AccessSet, KVLayout, OpMeta, make_device

dev = make_device("cpu", KVLayout(2, 4, 1, 4), 4, 4, sanitize=None)
a = torch.randn(1024, 1024)


def long_op():
    for _ in range(40):
        a @ a  # torch releases the GIL in here


dev.launch(COMPUTE, long_op, AccessSet(), OpMeta("forward"))
# the script ends with the op running on the stream's worker, the device never closed
"""


def test_the_process_exits_cleanly_with_an_op_still_running():
    """A script may end with a step in flight (a loop left early, the engine never closed). The
    stream workers are daemon threads: one still inside a torch op when the interpreter finalizes
    is unwound by `pthread_exit` through torch's C++ frames as it retakes the GIL, and the
    process aborted ("terminate called without an active exception", exit status 134) in 4 of
    4 runs. The device's exit hook now lets the workers finish what was launched first."""
    res = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_OP_RUNNING],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
