"""The native kernels' thread pool (kernels/csrc/pool.c): a call's items are claimed in chunks by the
caller and whichever helpers are running, so the output is the same bits on any number of
threads, calls reuse the helpers (one set for every library), concurrent callers, calls beside
yielding host work and forked children still get every item."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from kvtier.model import native
from kvtier.model.attention import LayerKind
from kvtier.model.paged import paged_attention, plan_group
from tests.model.test_attention_paths import HEADS, KV_HEADS, make_case

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")

# 37 decodes of 200-560 keys at head dim 64: ~2M key elements, past the kernel's threshold for
# helpers (128k), in uneven sequences
BATCH = [(200 + 10 * i, 1) for i in range(37)]


def _attention(threads: int) -> torch.Tensor:
    meta, q, k, v, cache = make_case(BATCH, 16, torch.bfloat16, seed=5, dim=64)
    plan = plan_group(meta, 0, LayerKind(), KV_HEADS, HEADS // KV_HEADS, native=True)
    native.set_threads(threads)
    try:
        return paged_attention(q, k, v, cache, plan, 0.125, None)
    finally:
        native.set_threads(None)


def _norm(threads: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1500, 512, generator=gen).bfloat16()  # 768k elements: past 512k
    residual = torch.randn(1500, 512, generator=gen).bfloat16()
    weight = torch.randn(512, generator=gen).bfloat16()
    kernels = native.kernels()
    assert kernels is not None
    native.set_threads(threads)
    try:
        out = kernels.rms_norm(x, weight, 1e-6, False, residual)
    finally:
        native.set_threads(None)
    return torch.cat([out, residual])  # the residual is summed in place


@pytest.mark.parametrize("run", [_attention, _norm], ids=["attention", "rms_norm"])
def test_same_bits_on_any_number_of_threads(run) -> None:
    one = run(1)
    assert not one.isnan().any()
    for threads in (2, 3, 8, 2, 64):  # helpers reused, added, more than there are chunks
        assert torch.equal(run(threads), one), threads


def test_calls_while_host_work_yields_get_every_item() -> None:
    """`pool_yield` (the grammar masks' fill beside the forward) sends idle helpers to sleep
    instead of spinning: a call made meanwhile wakes them and still gets every item, nested
    yields included, and calls after it are unchanged."""
    want = _attention(2)
    with native.pool_yield():
        assert torch.equal(_attention(2), want)
        with native.pool_yield():
            assert torch.equal(_attention(3), want)
        assert torch.equal(_attention(2), want)
    assert torch.equal(_attention(2), want)


def test_concurrent_callers_each_get_every_item() -> None:
    """A second caller while a job runs computes its own items alone; both are complete."""
    want = _attention(1)
    got: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            for _ in range(5):
                got.append(_attention(2))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 15
    assert all(torch.equal(g, want) for g in got)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(conn, q, cache, out, index) -> None:  # type: ignore[no-untyped-def]
    """Only the kernel call (no torch op: torch's own thread pools are not fork-safe)."""
    kernels = native.kernels()
    assert kernels is not None
    before = _tasks()
    native.set_threads(4)
    kernels.paged_attention(q, cache, out, index, 0.125, None)
    conn.send((out.view(torch.int16).numpy().tobytes(), before, _tasks()))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_forked_child_runs_the_kernels_alone() -> None:
    """After fork the child's pool names helpers it does not have (and its locks may have been
    held): the child computes every item on the calling thread and starts no helper."""
    want = _attention(2)  # the parent's helpers exist before the fork
    meta, q, k, v, cache = make_case(BATCH, 16, torch.bfloat16, seed=5, dim=64)
    plan = plan_group(meta, 0, LayerKind(), KV_HEADS, HEADS // KV_HEADS, native=True)
    paged_attention(q, k, v, cache, plan, 0.125, None)  # writes this step's keys into the cache
    assert plan.native is not None
    index, out = plan.native.index(), torch.empty_like(want)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_child, args=(child_end, q, cache, out, index))
    child.start()
    assert parent_end.poll(120), "the child's kernel call did not return"
    data, before, after = parent_end.recv()
    child.join(30)
    assert child.exitcode == 0
    got = torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16)
    assert torch.equal(got.view(want.shape), want)
    assert after == before, "the child started pool helpers"


SHARED_POOL_SCRIPT = """
import os, torch
from kvtier.model import native
kernels = native.kernels()
native.set_threads(3)
tasks = lambda: len(os.listdir('/proc/self/task'))
before = tasks()
gen = torch.Generator().manual_seed(0)
x = torch.randn(1500, 512, generator=gen)
kernels.rms_norm(x, torch.ones(512), 1e-6, False)  # the elementwise kernels
kernels.act_mul(torch.randn(1500, 1024, generator=gen), "silu")
if kernels.f32_linear:  # the linear kernels
    w = torch.randn(512, 512, generator=gen)
    kernels.linear_f32(x, kernels.pack_linear(w), 512, None)
print(tasks() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_every_kernel_calls_one_pool() -> None:
    """Calls into the elementwise and the linear kernels at 3 threads start two helpers in all,
    not two per kernel family: one pool (pool.c) keeps the same helpers hot across a layer's
    calls."""
    res = subprocess.run(
        [sys.executable, "-c", SHARED_POOL_SCRIPT],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.split()[-1]) == 2, res.stdout


HELPERS_SHARE_ONE_CORE = """
import os, sys, torch
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before the helpers start: theirs too
from kvtier.model import native
gen = torch.Generator().manual_seed(3)
x, residual = (torch.randn(1500, 512, generator=gen).bfloat16() for _ in range(2))  # past 512k
weight = torch.randn(512, generator=gen).bfloat16()
kernels = native.kernels()

def norm(threads):
    native.set_threads(threads)
    r = residual.clone()  # summed in place
    return torch.cat([kernels.rms_norm(x, weight, 1e-6, False, r), r])

want = norm(1)
first_spell_at = None
for _ in range(50_000):  # the pool judges its helpers by wall time: calls, however slow the box
    assert torch.equal(norm(2), want)
    stats = native.pool_stats()
    if stats["spells_alone"] >= 1 and first_spell_at is None:
        first_spell_at = stats["with_helpers"]
    if stats["spells_alone"] >= 2:
        break
print(first_spell_at or -1, stats["with_helpers"], stats["alone"], stats["spells_alone"])
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the process to one CPU")
def test_helpers_that_cannot_pay_are_left_out_and_tried_again() -> None:
    """Helpers on the caller's own core (a process pinned to one CPU; a co-tenant's busy core
    is the same in part) only slow the calls: the pool runs them alone for a spell, then tries
    the helpers again, and each call keeps the bits of one thread throughout."""
    done = subprocess.run(
        [sys.executable, "-c", HELPERS_SHARE_ONE_CORE],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    first_spell_at, with_helpers, alone, spells = map(int, done.stdout.split())
    assert spells >= 2 and alone > 0  # calls ran alone in spells
    assert with_helpers > first_spell_at  # and the helpers were tried again after the first
