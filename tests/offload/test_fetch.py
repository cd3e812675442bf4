"""`offload/fetch.py` `run_fetch` against real stores (a `DiskStore` in a temp folder): the walk
stops at the first miss, each tier is asked only for what the tiers above lack, and a hybrid
(full + window) request is served only to a boundary where every group has what a step there
reads (architecture.md §Chain, §H6)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.ids import BlockHash
from kvtier.kv.specs import FullAttention, KVSpec, SlidingWindow
from kvtier.offload.fetch import FetchJob, LowerTier, run_fetch
from kvtier.stores import DiskStore, StoreLayout

BS = 4
LAYOUT = StoreLayout("ab" * 16, 1, "float32", BS)
SPECS: list[KVSpec] = [FullAttention(BS), SlidingWindow(BS, window=8)]
HASHES = [BlockHash(bytes([i]) * 32) for i in range(10)]  # one chain of 10 blocks


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[list[DiskStore]]:
    stores = [DiskStore(tmp_path / f"d{i}", 1 << 20) for i in range(2)]
    yield stores
    for s in stores:
        s.close()


def job(num_groups: int = 2, start: int = 0, max_len: int = 40) -> FetchJob:
    views = [list(HASHES) for _ in range(num_groups)]
    return FetchJob("r", 0, start, max_len, views, frozenset(), [LAYOUT] * num_groups)


def put(store: DiskStore, group: int, positions: range) -> None:
    j = job()
    store.put([(j.want(group, p).key, bytes([group, p]) * 8) for p in positions])
    assert store.flush(10)


def test_a_full_and_window_model_is_served_to_the_end_of_what_both_groups_hold(
    disks: list[DiskStore],
) -> None:
    disk = disks[0]
    put(disk, 0, range(10))
    put(disk, 1, range(10))
    res = run_fetch(job(), SPECS, BS, [LowerTier("disk", disk, cheap_contains=True)])
    assert res.boundary == 40
    got = {(w.group, w.position) for w, _, _ in res.found}
    # the window group's step at 40 reads only its last two blocks (window 8 = 2 blocks)
    assert got == {(0, p) for p in range(10)} | {(1, 8), (1, 9)}
    assert all(payload == bytes([w.group, w.position]) * 8 for w, payload, _ in res.found)


def test_a_missing_window_block_lowers_the_boundary_never_a_partial_restore(
    disks: list[DiskStore],
) -> None:
    disk = disks[0]
    put(disk, 0, range(10))
    put(disk, 1, [p for p in range(10) if p != 8])  # the window's block 8 is gone
    res = run_fetch(job(), SPECS, BS, [LowerTier("disk", disk, cheap_contains=True)])
    # at 40 or 36 a step reads window block 8; at 32 it reads 6 and 7
    assert res.boundary == 32
    assert {(w.group, w.position) for w, _, _ in res.found if w.group == 1} == {(1, 6), (1, 7)}


def test_the_walk_asks_lower_tiers_only_for_what_upper_ones_lack(
    disks: list[DiskStore],
) -> None:
    upper, lower = disks
    put(upper, 0, range(4))
    put(lower, 0, range(10))
    tiers = [LowerTier("disk", upper, True), LowerTier("deeper", lower, True)]
    res = run_fetch(job(1), SPECS[:1], BS, tiers)
    assert res.boundary == 40
    assert {(w.position, t) for w, _, t in res.found} == {(p, 0 if p < 4 else 1) for p in range(10)}
    assert res.reach == [16, 40]
    assert lower.stats().num_queries == 12  # contains, then get, of positions 4-9 only


def test_the_walk_stops_at_the_first_miss(disks: list[DiskStore]) -> None:
    disk = disks[0]
    put(disk, 0, [0, 1, 2, 4, 5])
    res = run_fetch(job(1), SPECS[:1], BS, [LowerTier("disk", disk, cheap_contains=True)])
    assert res.boundary == 12
    assert [w.position for w, _, _ in res.found] == [0, 1, 2]
