"""`offload/chain.py` `TierChain` hit credit: a tier below the host is credited the tokens of the
blocks it promoted into host blocks, at the first admission that loads them from the host (its
external tokens), whichever request's lookup asked for them; never tokens the device served.
So, summed over admissions, the lower tiers' hit tokens never exceed the host's external tokens
(architecture.md §Chain). A real `DiskStore`, host tier, sim device and `HostBlockIO`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.device import KVLayout, make_device
from kvtier.offload.chain import TierChain
from kvtier.offload.fetch import FetchJob, LowerTier
from kvtier.runner.host_io import HostBlockIO
from kvtier.sched.connector import TierLookup
from kvtier.sched.request import Request
from kvtier.stores import DiskStore, StoreKey, StoreLayout
from tests.offload.factories import device, request, tier

BS = 4
LAYOUT = KVLayout(num_layer_slots=1, block_size=BS, num_kv_heads=1, head_dim=2)
STORE_LAYOUT = StoreLayout("cd" * 16, 1, "float32", BS)
PREFIX = list(range(100, 116))  # four blocks
NUM_HOST = 16


class HeldDiskStore(DiskStore):
    """A real disk store whose reads wait until the test opens `reads` (open at first), so a
    test can look up while a read is surely still running."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        super().__init__(root, capacity_bytes)
        self.reads = threading.Event()
        self.reads.set()

    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        assert self.reads.wait(30), "the test never let the disk read go on"
        return super().get(keys)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[TierChain, HeldDiskStore]]:
    from kvtier.kv import FullAttention

    dev_kv = device(32, [FullAttention(BS)])
    host = tier(dev_kv, NUM_HOST, record_published=True)
    sim = make_device("sim", LAYOUT, 32, NUM_HOST, sanitize="raise")
    disk = HeldDiskStore(tmp_path / "disk", 1 << 20)
    chain = TierChain(
        host, [LowerTier("disk", disk, True)], HostBlockIO(sim), [STORE_LAYOUT], timeout_s=30
    )
    yield chain, disk
    disk.reads.set()
    chain.close()
    sim.close()


def put_prefix(chain: TierChain, disk: DiskStore, req: Request, io_bytes: int) -> None:
    """The disk holds the request's first four blocks."""
    views = chain.host.coordinator.group_hashes(req.block_hashes)
    job = FetchJob("w", 0, 0, len(PREFIX), [views[0][:4]], frozenset(), [STORE_LAYOUT])
    disk.put([(job.want(0, p).key, bytes([p]) * io_bytes) for p in range(4)])
    assert disk.flush(10)


def settle(chain: TierChain, req: Request, num_hit: int) -> TierLookup:
    """Look up until the read below the host is in (the step loop's retries)."""
    deadline = time.monotonic() + 30
    while True:
        answer = chain.lookup(req, num_hit)
        if not answer.wait_for_load:
            return answer
        assert time.monotonic() < deadline, "the disk read never finished"
        time.sleep(0.005)


def disk_hits(chain: TierChain) -> int:
    return chain.tier_metrics["disk"].num_hit_tokens


def test_tokens_the_device_serves_by_admission_are_not_credited_to_the_disk(
    parts: tuple[TierChain, HeldDiskStore],
) -> None:
    chain, disk = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, 1, 2, 3])
    put_prefix(chain, disk, a, chain.io.block_bytes)
    assert chain.lookup(a, 0).wait_for_load  # the read of the prefix starts
    # meanwhile another request computed the prefix on the device: the admission's device hit
    answer = settle(chain, a, len(PREFIX))
    assert answer.num_tokens == 0
    chain.record_lookup(a)
    assert chain.tier_metrics["disk"].num_promoted_blocks == 4
    assert disk_hits(chain) == 0  # the admission loaded nothing from the host
    chain.finish_request(a)


def test_a_request_served_by_another_requests_read_credits_the_disk(
    parts: tuple[TierChain, HeldDiskStore],
) -> None:
    chain, disk = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, 1, 2, 3])
    b = request(chain.host.device_kv, "b", [*PREFIX, 4, 5, 6])
    put_prefix(chain, disk, a, chain.io.block_bytes)
    disk.reads.clear()
    assert chain.lookup(a, 0).wait_for_load  # a's read starts
    assert chain.lookup(b, 0).wait_for_load  # b waits on a's read
    chain.finish_request(a)  # a is aborted; its read still stages the blocks
    disk.reads.set()
    answer = settle(chain, b, 0)
    assert answer.num_tokens == len(PREFIX)
    chain.record_lookup(b)
    assert disk_hits(chain) == len(PREFIX)
    # the blocks are host hits now: a later admission that loads them credits the host only
    c = request(chain.host.device_kv, "c", [*PREFIX, 7, 8, 9])
    chain.finish_request(b)
    assert settle(chain, c, 0).num_tokens == len(PREFIX)
    chain.record_lookup(c)
    assert disk_hits(chain) == len(PREFIX)
    chain.finish_request(c)


def test_an_evicted_staged_block_forgets_where_it_came_from(
    parts: tuple[TierChain, HeldDiskStore],
) -> None:
    """A staged entry evicted before any admission loads it credits nobody, also when the same
    block is cached again later (stored from the device: a new entry)."""
    chain, disk = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, 1, 2, 3])
    put_prefix(chain, disk, a, chain.io.block_bytes)
    assert chain.lookup(a, 0).wait_for_load
    chain.finish_request(a)
    b = request(chain.host.device_kv, "b", [*PREFIX, 4, 5, 6])
    assert settle(chain, b, 0).num_tokens == len(PREFIX)  # staged: host hits now
    chain.finish_request(b)
    view = chain.host.coordinator.group_hashes(a.block_hashes)[0]
    keys = [(0, view[p]) for p in range(4)]
    assert chain.host.evict(keys) == 4
    chain.host.check_integrity()
    assert [chain.host.take_origin(k) for k in keys] == [None] * 4


def test_a_re_admission_after_preemption_is_counted_apart(
    parts: tuple[TierChain, HeldDiskStore],
) -> None:
    """As the device's prefix stats: hits of re-admissions after a preemption are their own
    counter, so the lower tiers' hit tokens stay within first admissions' external tokens."""
    chain, disk = parts
    a = request(chain.host.device_kv, "a", [*PREFIX, 1, 2, 3])
    put_prefix(chain, disk, a, chain.io.block_bytes)
    a.num_preemptions = 1
    assert chain.lookup(a, 0).wait_for_load
    assert settle(chain, a, 0).num_tokens == len(PREFIX)
    chain.record_lookup(a)
    m = chain.tier_metrics["disk"]
    assert (m.num_hit_tokens, m.num_preempted_hit_tokens) == (0, len(PREFIX))
    chain.finish_request(a)
