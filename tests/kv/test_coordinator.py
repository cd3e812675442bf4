"""Hybrid coordinator: one hit length every group can serve (architecture.md §Scenarios group E,
44-46), mixed block sizes, and every operation applied to every group."""

from __future__ import annotations

import pytest

from kvtier.kv import (
    BlockPool,
    ChunkedLocal,
    FullAttention,
    KVBlock,
    KVCacheCoordinator,
    Mamba,
    SlidingWindow,
)
from tests.kv.factories import admit, fresh_tokens, manager

HASHES = [f"h{i}".encode() for i in range(8)]


def full_swa(num_blocks: int = 64) -> KVCacheCoordinator:
    return KVCacheCoordinator([FullAttention(16), SlidingWindow(16, 32)], BlockPool(num_blocks))


def cache(coord: KVCacheCoordinator, group: int, positions: range) -> dict[int, KVBlock]:
    """Cache HASHES[i] for i in positions in `group` on free, evictable blocks."""
    p, out = coord.pool, {}
    for i in positions:
        (b,) = p.get_new_blocks(1)
        p.cache_full_blocks(group, [b], [HASHES[i]], 0, 1, 16)
        p.free([b])
        out[i] = b
    return out


def test_swa_limited_hybrid_hit_truncates_the_full_attention_hit():
    """Scenario 44."""
    coord = full_swa()
    full = cache(coord, 0, range(8))
    swa = cache(coord, 1, range(6))
    (full_hit, swa_hit), length = coord.find_longest_cache_hit(HASHES, 128)
    assert length == 96
    assert full_hit == [full[i] for i in range(6)]
    assert swa_hit == [coord.pool.null_block] * 4 + [swa[4], swa[5]]


def test_full_limited_hybrid_hit_bounds_the_window_search():
    """Scenario 45."""
    coord = full_swa()
    full = cache(coord, 0, range(3))
    swa = cache(coord, 1, range(8))
    (full_hit, swa_hit), length = coord.find_longest_cache_hit(HASHES, 128)
    assert length == 48
    assert full_hit == [full[0], full[1], full[2]]
    assert swa_hit == [coord.pool.null_block, swa[1], swa[2]]


def test_fully_cached_hybrid_hits_everything_up_to_the_recomputed_last_token():
    """Scenario 46."""
    coord = full_swa()
    full = cache(coord, 0, range(8))
    swa = cache(coord, 1, range(8))
    (full_hit, swa_hit), length = coord.find_longest_cache_hit(HASHES, 128)
    assert length == 128
    assert full_hit == [full[i] for i in range(8)]
    assert swa_hit == [coord.pool.null_block] * 6 + [swa[6], swa[7]]


def test_fixed_point_repeats_passes_until_no_group_shortens_the_hit():
    """Full (all cached) → 128; SWA W=32 → 96 (blocks 4, 5); SWA W=49 (3 blocks) → 64 (1-3).
    Second pass: SWA W=32 at 64 finds only the leading run [0] → 16; third pass changes nothing.
    A single pass would return a partial hit of 64 that the first window group cannot serve."""
    coord = KVCacheCoordinator(
        [FullAttention(16), SlidingWindow(16, 32), SlidingWindow(16, 49)], BlockPool(64)
    )
    cache(coord, 0, range(8))
    swa32 = cache(coord, 1, [0, 4, 5])
    swa49 = cache(coord, 2, [0, 1, 2, 3, 5])
    hits, length = coord.find_longest_cache_hit(HASHES, 128)
    assert length == 16
    assert [len(h) for h in hits] == [1, 1, 1]
    assert hits[1] == [swa32[0]] and hits[2] == [swa49[0]]


def test_no_common_hit_returns_empty_lists_for_every_group():
    coord = full_swa()
    cache(coord, 0, range(8))
    assert coord.find_longest_cache_hit(HASHES, 128) == ([[], []], 0)


def test_mixed_block_sizes_hash_at_gcd_and_hit_at_lcm():
    coord = KVCacheCoordinator([FullAttention(16), SlidingWindow(32, 64)], BlockPool(64))
    assert coord.hash_block_size == 16 and coord.alignment == 32
    fine = [f"f{i}".encode() for i in range(7)]
    assert coord.group_hashes(fine) == [fine, [fine[1], fine[3], fine[5]]]
    p = coord.pool
    for i in range(5):  # full group: 5 blocks of 16 = 80 tokens
        (b,) = p.get_new_blocks(1)
        p.cache_full_blocks(0, [b], [fine[i]], 0, 1, 16)
    for j in range(3):  # window group: 3 blocks of 32
        (b,) = p.get_new_blocks(1)
        p.cache_full_blocks(1, [b], [fine[2 * j + 1]], 0, 1, 32)
    (full_hit, swa_hit), length = coord.find_longest_cache_hit(fine, 112)
    assert length == 64  # full reaches 80 → rounded down to the 32-token alignment
    assert len(full_hit) == 4 and len(swa_hit) == 2


def test_mamba_hybrid_hit_is_the_last_snapshot_under_the_full_hit():
    m = manager(64, [FullAttention(4), Mamba(4)], max_model_len=64)
    tokens = fresh_tokens(13)
    seq = m.new_sequence("a", tokens)
    for n in (8, 5):  # snapshot at 8 only: the second step ends at 13
        assert m.allocate_slots(seq, n) is not None
        seq.num_computed_tokens += n
        m.cache_verified(seq, seq.num_computed_tokens)
    m.free("a")
    hits, length = m.get_computed_blocks(m.new_sequence("b", tokens))
    assert length == 8
    assert len(hits[0]) == 2 and [b.is_null for b in hits[1]] == [True, False]
    m.check_integrity()


def test_specs_are_validated_and_at_least_one_group_is_required():
    with pytest.raises(ValueError, match="at least one"):
        KVCacheCoordinator([], BlockPool(4))
    for bad in (FullAttention(0), SlidingWindow(16, 0), ChunkedLocal(16, 0)):
        with pytest.raises(ValueError, match=r"block_size|window|chunk"):
            KVCacheCoordinator([bad], BlockPool(4))


def test_every_operation_applies_to_every_group():
    m = manager(64, [FullAttention(16), SlidingWindow(16, 32)])
    tokens = fresh_tokens(100)
    admit(m, "a", tokens)
    full_ids, swa_ids = m.get_block_ids("a")
    assert len(full_ids) == len(swa_ids) == 7 and not set(full_ids) & set(swa_ids)
    assert m.remove_skipped_blocks("a", 100) == 4  # SWA skips 69 tokens: 4 blocks
    assert m.get_blocks("a")[0][0].block_hash is not None
    assert [b.is_null for b in m.get_blocks("a")[1]] == [True] * 4 + [False] * 3
    m.free("a")
    assert m.num_free_blocks == 63
    hits, length = m.get_computed_blocks(m.new_sequence("b", tokens))
    assert length == 96  # full hit 96; SWA needs blocks 4, 5, still cached after the free
    assert len(hits[0]) == 6 and [b.is_null for b in hits[1]] == [True] * 4 + [False] * 2
    m.check_integrity()
