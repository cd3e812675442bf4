"""Single-type managers: window / chunked / mamba arithmetic, pruning and cache-hit search
(architecture.md §Scenarios group B, 12-17; 18-19 are admission and live in test_manager.py)."""

from __future__ import annotations

import itertools

import pytest

from kvtier.kv import BlockPool, ChunkedLocal, FullAttention, KVBlock, Mamba, SlidingWindow
from kvtier.kv.single_type import SingleTypeManager, make_manager
from kvtier.kv.specs import KVSpec
from tests.kv.factories import ids, manager

T, F = True, False
_TAGS = itertools.count()


def single(spec: KVSpec, num_blocks: int = 64, **kw) -> tuple[SingleTypeManager, BlockPool]:
    p = BlockPool(num_blocks, **kw)
    return make_manager(spec, p, 0), p


def cache_pattern(
    mgr: SingleTypeManager, pattern: list[bool]
) -> tuple[list[bytes], dict[int, KVBlock]]:
    """Fresh hashes, one per position; position i is cached (on a free, evictable block) iff
    pattern[i]."""
    tag = next(_TAGS)
    hashes = [f"{tag}:h{i}".encode() for i in range(len(pattern))]
    blocks: dict[int, KVBlock] = {}
    for i, cached in enumerate(pattern):
        if cached:
            (b,) = mgr.pool.get_new_blocks(1)
            mgr.pool.cache_full_blocks(mgr.group_id, [b], [hashes[i]], 0, 1, mgr.block_size)
            mgr.pool.free([b])
            blocks[i] = b
    return hashes, blocks


def null_prefix(table: list[KVBlock]) -> int:
    n = 0
    while n < len(table) and table[n].is_null:
        n += 1
    return n


# ---- sliding window ------------------------------------------------------------------------------


def test_sliding_window_prune_nulls_a_growing_prefix_freeing_higher_positions_first():
    """Scenario 12. Reference ids 1000..1010 are reproduced by holding ids 1..999 first."""
    mgr, p = single(SlidingWindow(block_size=2, window=4), num_blocks=1011)
    p.get_new_blocks(999)
    new = mgr.allocate_new_blocks("r", 22, 0)
    assert ids(new) == list(range(1000, 1011))
    table = mgr.req_to_blocks["r"]
    prefixes, removed = [], []
    for processed in (0, 4, 5, 6, 7, 11):
        removed.append(mgr.remove_skipped_blocks("r", processed, None))
        prefixes.append(null_prefix(table))
    assert prefixes == [0, 0, 1, 1, 2, 4]
    assert removed == [0, 0, 1, 0, 1, 2]
    # fresh frees are prepended in free order: 1003 then 1002 went last, so they lead the queue
    assert p.free_queue.block_ids() == [1003, 1002, 1001, 1000]
    assert mgr.remove_skipped_blocks("r", 11, None) == 0
    assert mgr.num_real_blocks("r") == 7
    p.check_integrity()


def test_sliding_window_skipped_token_formula():
    """Scenario 13. We have no `extra_retained_tokens` (no multi-module MTP), so that case is absent."""
    spec = SlidingWindow(block_size=2, window=4)
    assert [spec.num_skipped_tokens(n) for n in (7, 3, 4, 0)] == [4, 0, 1, 0]


@pytest.mark.parametrize(
    ("pattern", "expected_blocks", "real_positions"),
    [
        ([F] * 10, 0, []),
        ([T], 1, [0]),
        ([T, F], 1, [0]),
        ([T, T], 2, [0, 1]),
        ([T, T, F], 2, [0, 1]),
        ([T, T, T], 3, [1, 2]),
        ([T, T, T, F], 3, [1, 2]),
        ([T, T, F, T, F, F, T, T, F, T, T, T], 12, [10, 11]),
        ([T, T, F, T, F, F, T, T, F, F, F], 8, [6, 7]),
        ([T, T, F, T, F, F, T, T, F, F, F, T], 8, [6, 7]),
    ],
)
def test_sliding_window_longest_hit_needs_the_blocks_just_before_its_end(
    pattern, expected_blocks, real_positions
):
    """Scenario 14 (W=4, bs=2: two contiguous cached blocks before the hit's end, or a run from 0)."""
    mgr, _ = single(SlidingWindow(block_size=2, window=4))
    hashes, blocks = cache_pattern(mgr, pattern)
    hit = mgr.find_longest_cache_hit(hashes, 2 * len(pattern), 2)
    assert len(hit) == expected_blocks
    assert [i for i, b in enumerate(hit) if not b.is_null] == real_positions
    assert all(hit[i] is blocks[i] for i in real_positions)
    assert all(b.ref_cnt == 0 for b in blocks.values()), "lookup touches nothing"


def test_sliding_window_hit_respects_a_coarser_alignment():
    """With alignment 4 tokens (2 blocks) a hit may only end at an even block position."""
    mgr, _ = single(SlidingWindow(block_size=2, window=4))
    hashes, _ = cache_pattern(mgr, [F, T, T, T, T, F])
    assert len(mgr.find_longest_cache_hit(hashes, 12, 2)) == 5
    hit = mgr.find_longest_cache_hit(hashes, 12, 4)
    assert len(hit) == 4 and [b.is_null for b in hit] == [T, T, F, F]
    hashes, _ = cache_pattern(mgr, [F, F, T, T, F])  # run [2,4) ends at 4: aligned
    assert len(mgr.find_longest_cache_hit(hashes, 10, 4)) == 4
    hashes, _ = cache_pattern(mgr, [F, T, T, F])  # run [1,3): its only aligned end 2 lacks block 0
    assert mgr.find_longest_cache_hit(hashes, 8, 4) == []


def test_sliding_window_hit_is_bounded_by_max_length():
    mgr, _ = single(SlidingWindow(block_size=2, window=4))
    hashes, _ = cache_pattern(mgr, [T] * 6)
    assert len(mgr.find_longest_cache_hit(hashes, 9, 2)) == 4
    assert mgr.find_longest_cache_hit(hashes, 1, 2) == []


# ---- chunked local -------------------------------------------------------------------------------


def test_chunked_local_prune_nulls_whole_earlier_chunks():
    """Scenario 15 (C=4, bs=2)."""
    mgr, p = single(ChunkedLocal(block_size=2, chunk=4))
    mgr.allocate_new_blocks("r", 22, 0)
    table = mgr.req_to_blocks["r"]
    prefixes = []
    for processed in (0, 4, 6, 12):
        mgr.remove_skipped_blocks("r", processed, None)
        prefixes.append(null_prefix(table))
    assert prefixes == [0, 2, 2, 6]
    assert p.num_free_blocks == 63 - 11 + 6
    p.check_integrity()


_ARBITRARY = [T, F, T, T, F, F, T, F]


@pytest.mark.parametrize(
    ("pattern", "tail", "expected_blocks"),
    [
        ([T], 0, 1),
        ([T, T, F], 0, 2),
        ([T, T, T], 0, 3),
        ([T, T, T, F], 1, 4),
        ([*_ARBITRARY, F], 1, 8),
        ([*_ARBITRARY, T], 1, 9),
        ([*_ARBITRARY, F, F], 0, 10),
    ],
)
def test_chunked_local_hit_looks_up_only_the_current_chunk(pattern, tail, expected_blocks):
    """Scenario 16 (C=4, bs=2). We assert the exact null prefix (every block left of the current
    chunk), which is stronger than the scenario's lower bound (expected − 1) // 2."""
    mgr, _ = single(ChunkedLocal(block_size=2, chunk=4))
    hashes, blocks = cache_pattern(mgr, pattern)
    max_length = 2 * len(pattern) + tail
    hit = mgr.find_longest_cache_hit(hashes, max_length, 2)
    assert len(hit) == expected_blocks
    local_start = max_length // 4 * 4 // 2
    assert all(b.is_null for b in hit[:local_start])
    assert all(hit[i] is blocks[i] for i in range(local_start, len(hit)))


def test_chunked_local_skipped_tokens_are_whole_chunks():
    spec = ChunkedLocal(block_size=2, chunk=4)
    assert [spec.num_skipped_tokens(n) for n in (0, 3, 4, 7, 8, 13)] == [0, 0, 4, 4, 8, 12]


# ---- new-request charge --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "num_null_hits", "expected"),
    [(1000, 0, 20), (1000, 5, 15), (4, 0, 12)],
    ids=["all-hits-evictable", "half-null-hits", "hits-inside-skipped-region"],
)
def test_new_request_charge_counts_new_blocks_and_evictable_hits_outside_skipped(
    window, num_null_hits, expected
):
    """Scenario 17: bs 2, 40 tokens (20 blocks), 10 hit blocks with ref 0, 20 tokens computed."""
    mgr, p = single(SlidingWindow(block_size=2, window=window))
    _, blocks = cache_pattern(mgr, [T] * 10)
    hits = [blocks[i] for i in range(10)]
    hits[:num_null_hits] = [p.null_block] * num_null_hits
    assert mgr.num_blocks_to_allocate("r", 40, hits, 20) == expected
    p.touch([hits[-1]])  # a hit already held by someone costs no free block
    assert mgr.num_blocks_to_allocate("r", 40, hits, 20) == expected - 1


def test_add_computed_blocks_touches_only_hits_outside_the_skipped_region():
    mgr, p = single(SlidingWindow(block_size=2, window=4))
    _, blocks = cache_pattern(mgr, [T] * 10)
    hits = [blocks[i] for i in range(10)]
    mgr.add_computed_blocks("r", hits, 20)
    table = mgr.req_to_blocks["r"]
    assert [b.is_null for b in table] == [T] * 8 + [F, F]
    assert [b.ref_cnt for b in hits] == [0] * 8 + [1, 1]
    assert mgr.num_real_blocks("r") == 2
    new = mgr.allocate_new_blocks("r", 40, 20)
    assert len(new) == 10 and len(table) == 20
    assert mgr.num_cached_block["r"] == 10
    p.check_integrity()


def test_running_request_charge_is_growth_only():
    mgr, _ = single(SlidingWindow(block_size=2, window=4))
    mgr.allocate_new_blocks("r", 7, 0)
    assert mgr.num_blocks_to_allocate("r", 8, [], 7) == 0
    assert mgr.num_blocks_to_allocate("r", 13, [], 7) == 3


def test_allocation_after_skipping_pads_skipped_positions_with_the_null_block():
    """External tokens far past the window: positions below the window are never allocated."""
    mgr, _ = single(SlidingWindow(block_size=2, window=4))
    assert mgr.num_blocks_to_allocate("r", 22, [], 20) == 3
    new = mgr.allocate_new_blocks("r", 22, 20)
    table = mgr.req_to_blocks["r"]
    assert new == table and [b.is_null for b in table] == [T] * 8 + [F] * 3


def test_prune_frees_through_the_quarantine():
    mgr, p = single(SlidingWindow(block_size=2, window=4))
    mgr.allocate_new_blocks("r", 8, 0)
    free_before = p.num_free_blocks
    assert mgr.remove_skipped_blocks("r", 7, last_step_seq=3) == 2
    assert p.num_free_blocks == free_before and p.num_quarantined_refs == 2
    p.release_quarantine(3)
    assert p.num_free_blocks == free_before + 2
    p.check_integrity()


def test_free_releases_table_tail_first_and_forgets_the_request():
    mgr, p = single(FullAttention(block_size=2), num_blocks=6)
    mgr.allocate_new_blocks("r", 5, 0)
    mgr.free("r", None)
    assert p.free_queue.block_ids() == [3, 2, 1, 4, 5]
    assert "r" not in mgr.req_to_blocks and mgr.num_real_blocks("r") == 0
    mgr.free("r", None)  # unknown request: nothing to do


# ---- full attention ------------------------------------------------------------------------------


def test_full_attention_hit_stops_at_first_miss_and_rounds_down_to_alignment():
    mgr, _ = single(FullAttention(block_size=2))
    hashes, blocks = cache_pattern(mgr, [T, T, T, F, T])
    assert mgr.find_longest_cache_hit(hashes, 10, 2) == [blocks[0], blocks[1], blocks[2]]
    assert mgr.find_longest_cache_hit(hashes, 10, 4) == [blocks[0], blocks[1]]
    assert mgr.find_longest_cache_hit(hashes, 3, 2) == [blocks[0]]


def test_full_attention_never_prunes():
    mgr, _ = single(FullAttention(block_size=2))
    mgr.allocate_new_blocks("r", 20, 0)
    assert mgr.remove_skipped_blocks("r", 20, None) == 0
    assert not any(b.is_null for b in mgr.req_to_blocks["r"])


# ---- mamba ---------------------------------------------------------------------------------------


def test_mamba_keeps_one_real_state_block_and_prunes_all_but_the_last():
    mgr, p = single(Mamba(block_size=4))
    assert Mamba(4).num_skipped_tokens(9) == 8
    assert mgr.num_blocks_to_allocate("r", 10, [], 0) == 1
    new = mgr.allocate_new_blocks("r", 10, 0)
    assert new == mgr.req_to_blocks["r"] and [b.is_null for b in new] == [T, T, F]
    assert mgr.num_blocks_to_allocate("r", 17, [], 10) == 1  # two positions of growth, one block
    mgr.allocate_new_blocks("r", 17, 10)
    assert [b.is_null for b in mgr.req_to_blocks["r"]] == [T, T, F, T, F]
    assert mgr.num_real_blocks("r") == 2
    assert mgr.remove_skipped_blocks("r", 17, None) == 1
    assert mgr.num_real_blocks("r") == 1 and not mgr.req_to_blocks["r"][4].is_null
    p.check_integrity()


@pytest.mark.parametrize(
    ("steps", "cached_positions"),
    [((8, 3, 1), [1, 2]), ((6, 6), [2]), ((5, 5, 2), [2]), ((3, 3, 3, 3), [2])],
    ids=["8+3+1", "6+6", "5+5+2", "3x4"],
)
def test_mamba_snapshot_is_cacheable_only_when_a_step_ended_on_the_boundary(
    steps, cached_positions
):
    """A state block is published only if some processed step ended exactly at its end
    (otherwise it holds a later state); the scheduler reports each verified end. bs 4, 12-token
    prompt."""
    m = manager(32, [Mamba(4)])
    seq = m.new_sequence("r", list(range(12)))
    for n in steps:
        assert m.allocate_slots(seq, n) is not None
        seq.num_computed_tokens += n
        m.cache_verified(seq, seq.num_computed_tokens)
    table = m.get_blocks("r")[0]
    cached = [i for i, b in enumerate(table) if b.block_hash is not None]
    assert cached == cached_positions
    assert all(table[i].block_hash == seq.block_hashes[i] for i in cached)
    m.check_integrity()


def test_mamba_snapshot_of_a_rolled_back_scheduled_end_is_never_published():
    """architecture.md §Rollback: 6 tokens, then a token and a draft ending at 8, the draft
    rejected (7 verified), then 5 more: only position 2 holds a true snapshot."""
    m = manager(32, [FullAttention(4), Mamba(4)])
    seq = m.new_sequence("r", list(range(20)))
    for n, verified in ((6, 6), (2, 7), (5, 12)):
        assert m.allocate_slots(seq, n) is not None
        seq.num_computed_tokens = verified
        m.cache_verified(seq, verified)
    table = m.get_blocks("r")[1]
    assert [i for i, b in enumerate(table) if b.block_hash is not None] == [2]
    m.check_integrity()


def test_mamba_hit_is_the_last_cached_aligned_snapshot():
    mgr, p = single(Mamba(block_size=2))
    hashes, blocks = cache_pattern(mgr, [T, F, T, F, F])
    hit = mgr.find_longest_cache_hit(hashes, 10, 2)
    assert len(hit) == 3 and hit[2] is blocks[2] and all(b.is_null for b in hit[:2])
    assert len(mgr.find_longest_cache_hit(hashes, 10, 4)) == 0  # only block ends 4, 8 allowed
    hashes, blocks = cache_pattern(mgr, [F, T, F, F])
    assert mgr.find_longest_cache_hit(hashes, 8, 4) == [p.null_block, blocks[1]]


def test_mamba_request_restored_from_a_snapshot_holds_only_that_state_block():
    mgr, p = single(Mamba(block_size=2))
    hashes, blocks = cache_pattern(mgr, [T, T, T])
    hit = mgr.find_longest_cache_hit(hashes, 6, 2)
    assert mgr.num_blocks_to_allocate("r", 7, hit, 6) == 2  # the evictable snapshot + one new
    mgr.add_computed_blocks("r", hit, 6)
    assert blocks[2].ref_cnt == 1 and blocks[1].ref_cnt == 0
    assert len(mgr.allocate_new_blocks("r", 7, 6)) == 1
    assert mgr.num_real_blocks("r") == 2
    p.check_integrity()


# ---- specs ---------------------------------------------------------------------------------------


def test_steady_blocks_per_spec():
    assert FullAttention(16).steady_blocks(33) == 3
    assert SlidingWindow(16, 1024).steady_blocks(16384) == 65
    assert SlidingWindow(16, 1024).steady_blocks(100) == 7
    assert ChunkedLocal(16, 1024).steady_blocks(16384) == 64
    assert ChunkedLocal(16, 1000).steady_blocks(16384) == 64  # 63 blocks + 1 for misalignment
    assert Mamba(16).steady_blocks(16384) == 1 and Mamba(16).steady_blocks(0) == 0


def test_transient_blocks_per_spec():
    assert FullAttention(16).transient_blocks(1024, 5, 16384) == 0
    assert SlidingWindow(16, 512).transient_blocks(1024, 5, 16384) == 64 + 5
    assert ChunkedLocal(16, 512).transient_blocks(1000, 2, 16384) == 63 + 2
    assert Mamba(16).transient_blocks(1024, 5, 16384) == 64 + 5
    assert all(
        s.transient_blocks(0, 5, 16384) == 0
        for s in (SlidingWindow(16, 512), ChunkedLocal(16, 512), Mamba(16))
    )


def test_transient_reserve_is_capped_by_what_requests_can_hold():
    # W 64, bs 16, max length 256: a request holds at most 16 blocks, 5 of them steady.
    assert SlidingWindow(16, 64).transient_blocks(1024, 1, 256) == 11
    assert SlidingWindow(16, 64).transient_blocks(1024, 3, 256) == 33
    assert SlidingWindow(16, 64).transient_blocks(1024, 8, 256) == 64 + 8
    assert Mamba(8).transient_blocks(48, 2, 16) == 2  # two blocks per table, one steady
