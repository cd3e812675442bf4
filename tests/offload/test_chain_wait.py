"""`TierChain.wait_for_io` waits for the reads someone waits on (architecture.md §Progress): a read
orphaned by an abort or a timed-out lookup never ends the wait, so an engine whose only request
waits on a hung store idles instead of stepping empty forwards. A real `DiskStore` whose reads
are held, a host tier, the sim device and a clock the test moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.device import make_device
from kvtier.kv import FullAttention
from kvtier.offload.chain import TierChain
from kvtier.offload.fetch import LowerTier
from kvtier.runner.host_io import HostBlockIO
from tests.offload.factories import device, request, tier
from tests.offload.test_chain_credit import (
    LAYOUT,
    NUM_HOST,
    PREFIX,
    STORE_LAYOUT,
    HeldDiskStore,
    put_prefix,
)

OTHER = list(range(200, 216))  # four blocks, no block in common with PREFIX


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[TierChain, HeldDiskStore, Clock]]:
    dev_kv = device(32, [FullAttention(4)])
    host = tier(dev_kv, NUM_HOST, record_published=True)
    sim = make_device("sim", LAYOUT, 32, NUM_HOST, sanitize="raise")
    disk = HeldDiskStore(tmp_path / "disk", 1 << 20)
    clock = Clock()
    lowers = [LowerTier("disk", disk, True)]
    chain = TierChain(host, lowers, HostBlockIO(sim), [STORE_LAYOUT], timeout_s=1, clock=clock)
    yield chain, disk, clock
    disk.reads.set()
    chain.close()
    sim.close()


def test_an_orphaned_read_past_its_deadline_does_not_end_the_wait(
    parts: tuple[TierChain, HeldDiskStore, Clock],
) -> None:
    """Issue 41's busy spin: `a`'s read hangs and `a` is aborted; once that read's deadline has
    passed, every wait returned at once while `b` still waited on its own read, so the engine
    stepped an empty forward per `step()`. Now only `b`'s read and deadline end the wait."""
    chain, disk, clock = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, 1, 2, 3])
    b = request(chain.host.device_kv, "b", [*OTHER, 4, 5, 6])
    put_prefix(chain, disk, a, chain.io.block_bytes)
    put_prefix(chain, disk, b, chain.io.block_bytes)
    disk.reads.clear()  # the store hangs
    assert chain.lookup(a, 0).wait_for_load  # a's read starts, deadline 1
    chain.finish_request(a)  # aborted: nobody waits on that read any more
    clock.now = 5.0
    assert chain.lookup(b, 0).wait_for_load  # b's read starts, deadline 6
    assert chain.waiting_on_io() == {"b"}
    assert chain.wait_for_io(0.01) is False  # nothing landed, no awaited deadline passed
    clock.now = 10.0  # b's deadline passed: its lookup times out, the read is orphaned too
    assert chain.wait_for_io(0.01) is True
    assert not chain.lookup(b, 0).wait_for_load
    assert chain.metrics.num_fetch_timeouts == 1
    c = request(chain.host.device_kv, "c", [*OTHER, 7, 8, 9])
    assert chain.lookup(c, 0).wait_for_load  # waits on b's read (it starts at c's next block)
    assert chain.wait_for_io(0.01) is True  # ... whose deadline passed: c's lookup stops now
    assert not chain.lookup(c, 0).wait_for_load
    d = request(chain.host.device_kv, "d", [*range(300, 316), 1, 2, 3])
    put_prefix(chain, disk, d, chain.io.block_bytes)
    assert chain.lookup(d, 0).wait_for_load  # a fresh read, deadline 11
    assert chain.wait_for_io(0.01) is False  # a's and b's orphaned reads end no wait
    disk.reads.set()  # every read lands; the orphans' blocks are staged for later lookups
    assert chain.wait_for_io(30) is True
    for r in (b, c, d):
        chain.finish_request(r)


def test_a_lookup_of_many_blocks_waits_at_most_the_timeout(
    parts: tuple[TierChain, HeldDiskStore, Clock],
) -> None:
    """Issue 37: a lookup waits at most `timeout_s` in total, however many blocks it asks for.
    The deadline grew with the blocks beyond the host's hit (`timeout_s` per 64), so a long
    prompt against a store that answers, slowly, waited past `--kv-tier-timeout-s`."""
    chain, disk, clock = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, *range(1000, 1400), 1, 2, 3])
    assert (a.num_tokens - 1) // 4 > 64  # blocks beyond the host's (empty) hit
    put_prefix(chain, disk, a, chain.io.block_bytes)
    disk.reads.clear()  # the store hangs
    clock.now = 3.0
    assert chain.lookup(a, 0).wait_for_load  # the read starts: deadline 3 + timeout_s
    clock.now = 3.99
    assert chain.lookup(a, 0).wait_for_load
    assert chain.wait_for_io(0.01) is False
    clock.now = 4.0
    assert chain.wait_for_io(0.01) is True  # the deadline passed
    assert not chain.lookup(a, 0).wait_for_load  # the host's answer, the rest recomputed
    assert chain.metrics.num_fetch_timeouts == 1
    chain.finish_request(a)
