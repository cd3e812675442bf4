"""BlockPool and the full-attention prefix cache: architecture.md §Scenarios group A (1-11), the
quarantine, events, eviction and the integrity check.

Scenarios drive the pool through the `KVCacheManager` facade with one full-attention group of
block size 16, as the scenarios' harness does; pool-only behaviour is tested on `BlockPool`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvtier.kv import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    HashExtras,
    IntegrityError,
    MultiModalItem,
)
from tests.kv.factories import admit, fresh_tokens, ids, manager, pool

BS = 16


def _hashed(p: BlockPool, block_ids: list[int]) -> list[bool]:
    return [p.blocks[i].block_hash is not None for i in block_ids]


# ---- group A scenarios ---------------------------------------------------------------------------


def test_pool_initialisation_null_block_and_ascending_free_order():
    """Scenario 1."""
    p = pool(11)
    assert p.null_block.block_id == 0 and p.null_block.is_null
    assert 0 not in p.free_queue.block_ids()
    assert p.num_free_blocks == 10
    assert p.free_queue.block_ids() == list(range(1, 11))
    assert p.usage == 0.0
    assert p.reset_prefix_cache() is True
    p.check_integrity()


def test_shared_prefix_free_order_fresh_prepended_cached_appended():
    """Scenario 2 (upstream test_prefill): newest-upstream free policy (#33710)."""
    m = manager(11)
    p = m.pool
    common = [i for i in range(3) for _ in range(BS)]
    r0 = admit(m, "r0", common + [3] * 7)
    assert m.get_block_ids("r0") == ([1, 2, 3, 4],)
    assert _hashed(p, [1, 2, 3, 4]) == [True, True, True, False]
    assert [p.blocks[i].block_hash for i in (1, 2, 3)] == r0.block_hashes
    assert [p.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]

    r1 = m.new_sequence("r1", common + [5] * 5)
    hits, num_hit = m.get_computed_blocks(r1)
    assert ids(hits[0]) == [1, 2, 3] and num_hit == 48
    new = m.allocate_slots(r1, 5, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert new is not None and ids(new[0]) == [5]
    assert [p.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert m.num_free_blocks == 5

    m.free("r0")
    m.free("r1")
    assert m.num_free_blocks == 10
    assert p.free_queue.block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    r2 = m.new_sequence("r2", common + [6] * 6)
    hits, num_hit = m.get_computed_blocks(r2)
    assert ids(hits[0]) == [1, 2, 3] and num_hit == 48
    new = m.allocate_slots(r2, 6, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert new is not None and ids(new[0]) == [5]
    assert m.num_free_blocks == 6
    assert not {1, 2, 3} & set(p.free_queue.block_ids())
    m.check_integrity()


def test_whole_request_free_puts_chain_tail_before_head_in_eviction_order():
    """Scenario 3 (upstream test_evict)."""
    m = manager(11)
    p = m.pool
    admit(m, "r0", list(range(87)))
    admit(m, "r1", list(range(87, 135)))
    assert m.get_block_ids("r0") == ([1, 2, 3, 4, 5, 6],)
    assert m.get_block_ids("r1") == ([7, 8, 9],)
    assert m.num_free_blocks == 1
    m.free("r0")
    assert p.free_queue.block_ids() == [6, 10, 5, 4, 3, 2, 1]
    m.free("r1")
    assert p.free_queue.block_ids() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    r2 = m.new_sequence("r2", list(range(35)))
    hits, num_hit = m.get_computed_blocks(r2)
    assert ids(hits[0]) == [1, 2] and num_hit == 32
    new = m.allocate_slots(r2, 3, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert new is not None and ids(new[0]) == [6]
    assert m.num_free_blocks == 7
    m.check_integrity()


def test_reused_block_loses_its_hash_and_emits_removed_event():
    """Scenario 4."""
    m = manager(2, enable_kv_events=True)
    tokens = fresh_tokens(16)
    r0 = admit(m, "r0", tokens)
    (h0,) = r0.block_hashes
    m.free("r0")
    m.take_events()

    r1 = m.new_sequence("r1", tokens[:15])
    hits, num_hit = m.get_computed_blocks(r1)
    assert num_hit == 0 and hits == [[]]
    new = m.allocate_slots(r1, 15)
    assert new is not None and ids(new[0]) == [1]
    assert m.pool.blocks[1].block_hash is None
    assert m.pool.num_cached_entries() == 0
    assert m.pool.get_cached_block(0, h0) is None
    assert m.take_events() == [BlockRemoved([h0], 0, "device")]


def test_last_prompt_token_is_always_recomputed():
    """Scenario 5."""
    m = manager(11)
    tokens = fresh_tokens(49)
    admit(m, "a", tokens)
    m.free("a")
    assert m.get_computed_blocks(m.new_sequence("b", tokens[:48]))[1] == 32
    assert m.get_computed_blocks(m.new_sequence("c", [*tokens[:48], 7]))[1] == 48


_BASE = HashExtras(adapter_name="lora-a", mm_items=(MultiModalItem("img-1", 4, 8),))


@pytest.mark.parametrize(
    ("extras", "expected_hit"),
    [
        (HashExtras(adapter_name="lora-b", mm_items=_BASE.mm_items), 0),
        (HashExtras("salt", _BASE.adapter_name, _BASE.mm_items), 0),
        (HashExtras(adapter_name="lora-a", mm_items=(MultiModalItem("img-2", 4, 8),)), 0),
        (HashExtras(adapter_name="lora-a", mm_items=(MultiModalItem("img-1", 4, 8),)), 32),
    ],
    ids=["other-adapter", "cache-salt", "other-mm-item", "identical"],
)
def test_extra_keys_isolate_prefix_caches(extras, expected_hit):
    """Scenario 6."""
    m = manager(11)
    tokens = fresh_tokens(33)
    admit(m, "a", tokens, extras=_BASE)
    m.free("a")
    assert m.get_computed_blocks(m.new_sequence("b", tokens, extras))[1] == expected_hit


def test_identical_content_is_registered_side_by_side_not_deduplicated():
    """Scenario 7. Our block 0 is the null block (never cached), so the four blocks are 1..4."""
    p = pool(5)
    k0, k1, k2 = b"k0", b"k1", b"k2"
    blocks = p.get_new_blocks(4)
    p.cache_full_blocks(0, blocks, [k0, k1, k2, k0], 0, 4, BS)
    assert p.num_cached_entries() == 4
    assert p.get_cached_block(0, k0) in (blocks[0], blocks[3])
    assert p.get_cached_block(0, k1) is blocks[1]
    assert p.get_cached_block(0, k2) is blocks[2]
    p.check_integrity()

    p.evict_blocks([1])
    assert p.get_cached_block(0, k0) is blocks[3]
    p.evict_blocks([2])
    assert p.get_cached_block(0, k1) is None
    p.evict_blocks([3])
    assert p.num_cached_entries() == 1 and p.get_cached_block(0, k0) is blocks[3]
    p.check_integrity()
    p.evict_blocks([4])
    assert p.num_cached_entries() == 0 and p.get_cached_block(0, k0) is None
    assert all(b.ref_cnt == 1 for b in blocks), "evict_blocks touches the map only"
    p.check_integrity()


def test_failed_allocation_changes_nothing():
    """Scenario 8."""
    m = manager(11)
    admit(m, "r0", fresh_tokens(144))
    before = m.pool.free_queue.block_ids()
    r1 = m.new_sequence("r1", fresh_tokens(20))
    assert m.allocate_slots(r1, 20) is None
    assert m.num_free_blocks == 1
    assert m.pool.free_queue.block_ids() == before
    assert m.get_block_ids("r1") == ([],)
    assert not m.coordinator.has_request("r1")
    assert m.usage == pytest.approx(0.9)
    m.check_integrity()


def test_decode_growth_allocates_on_block_boundary_and_hashes_late():
    """Scenario 9 (upstream test_decode)."""
    m = manager(11)
    r0 = admit(m, "r0", fresh_tokens(55))
    assert m.get_block_ids("r0") == ([1, 2, 3, 4],)

    r0.append_output_token_ids(fresh_tokens(4))
    assert m.allocate_slots(r0, 4) == [[]]
    assert m.pool.blocks[4].block_hash is None

    r0.num_computed_tokens = 59
    r0.append_output_token_ids(fresh_tokens(19))
    new = m.allocate_slots(r0, 19)
    assert new is not None and len(new[0]) == 1
    table = m.get_blocks("r0")[0]
    assert len(table) == 5
    assert table[3].block_hash == r0.block_hashes[3]
    assert table[4].block_hash is None
    m.check_integrity()


def test_events_stored_on_allocate_and_cleared_on_reset():
    """Scenario 10. Our medium for the accelerator pool is called "device" (vLLM: GPU)."""
    m = manager(11, enable_kv_events=True)
    tokens = fresh_tokens(33)
    r = admit(m, "r", tokens)
    assert m.take_events() == [BlockStored(r.block_hashes, None, tokens[:32], BS, 0, "device")]
    assert m.reset_prefix_cache() is False
    assert m.take_events() == []
    m.free("r")
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared("device")]
    assert all(b.block_hash is None for b in m.pool.blocks)
    assert m.pool.num_cached_entries() == 0
    assert m.get_computed_blocks(m.new_sequence("again", tokens))[1] == 0
    m.check_integrity()


def test_caching_disabled_reuses_freed_blocks_lifo():
    """Scenario 11 (#51482)."""
    m = manager(6, enable_caching=False)
    admit(m, "r0", fresh_tokens(48))
    assert m.get_block_ids("r0") == ([1, 2, 3],)
    assert m.pool.num_cached_entries() == 0
    m.free("r0")
    assert m.pool.free_queue.block_ids() == [3, 2, 1, 4, 5]
    assert ids(m.pool.get_new_blocks(1)) == [3]


# ---- pool mechanics ------------------------------------------------------------------------------


def test_pool_needs_a_usable_block_besides_the_null_block():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_allocation_evicts_cached_blocks_from_the_lru_end_with_events():
    p = pool(4, enable_kv_events=True)
    a, b, c = p.get_new_blocks(3)
    p.cache_full_blocks(0, [a, b], [b"ha", b"hb"], 0, 2, BS, list(range(32)))
    stored = p.take_events()
    assert stored == [BlockStored([b"ha", b"hb"], None, list(range(32)), BS, 0, "device")]
    p.free([b, a, c])  # c fresh -> head; b, a cached -> tail in that order
    assert p.free_queue.block_ids() == [3, 2, 1]
    assert ids(p.get_new_blocks(2)) == [3, 2]
    assert p.take_events() == [BlockRemoved([b"hb"], 0, "device")]
    assert p.get_cached_block(0, b"hb") is None and p.get_cached_block(0, b"ha") is a
    p.check_integrity()


def test_cache_full_blocks_event_names_parent_and_skips_already_hashed_blocks():
    p = pool(5, enable_kv_events=True)
    blocks = p.get_new_blocks(3)
    p.cache_full_blocks(0, blocks, [b"h0", b"h1", b"h2"], 0, 1, 2, [10, 11, 12, 13, 14, 15])
    p.cache_full_blocks(0, blocks, [b"h0", b"h1", b"h2"], 0, 3, 2, [10, 11, 12, 13, 14, 15])
    assert p.take_events() == [  # each event's tokens are its own blocks', after its parent
        BlockStored([b"h0"], None, [10, 11], 2, 0, "device"),
        BlockStored([b"h1", b"h2"], b"h0", [12, 13, 14, 15], 2, 0, "device"),
    ]
    p.cache_full_blocks(0, blocks + p.get_new_blocks(1), [b"h0", b"h1", b"h2", b"h3"], 3, 4, 2)
    assert p.take_events()[0].parent_block_hash == b"h2"


def test_stored_events_cover_runs_of_first_copies_with_their_own_tokens():
    """A consumer (vllm-router) hashes each event's tokens per block and links the run to its
    parent: a skipped block (null, or a second copy of a cached hash) splits the run."""
    p = pool(8, enable_kv_events=True)
    a, b, c, d = p.get_new_blocks(4)
    p.cache_full_blocks(0, [a], [b"h1"], 0, 1, 2, [10, 11])
    p.take_events()
    blocks = [p.null_block, b, c, d]
    p.cache_full_blocks(0, blocks, [b"h0", b"h1", b"h2", b"h3"], 0, 4, 2, list(range(10, 18)))
    assert p.take_events() == [BlockStored([b"h2", b"h3"], b"h1", [14, 15, 16, 17], 2, 0, "device")]


def test_removed_event_only_when_the_last_copy_of_a_hash_goes():
    p = pool(4, enable_kv_events=True)
    a, b = p.get_new_blocks(2)
    p.cache_full_blocks(0, [a], [b"h"], 0, 1, 2, [1, 2])
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, 2, [1, 2])
    assert p.take_events() == [BlockStored([b"h"], None, [1, 2], 2, 0, "device")]
    p.evict_blocks([a.block_id])
    assert p.take_events() == []  # b still holds the hash
    p.evict_blocks([b.block_id])
    assert p.take_events() == [BlockRemoved([b"h"], 0, "device")]


def test_cache_full_blocks_skips_the_null_block():
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [p.null_block, b], [b"n", b"h"], 0, 2, BS)
    assert p.null_block.block_hash is None
    assert p.get_cached_block(0, b"n") is None and p.get_cached_block(0, b"h") is b
    p.check_integrity()


def test_groups_have_separate_hash_maps():
    p = pool(4)
    a, b = p.get_new_blocks(2)
    p.cache_full_blocks(0, [a], [b"h"], 0, 1, BS)
    p.cache_full_blocks(1, [b], [b"h"], 0, 1, BS)
    assert p.get_cached_block(0, b"h") is a and p.get_cached_block(1, b"h") is b
    p.evict_blocks([a.block_id])
    assert p.get_cached_block(0, b"h") is None and p.get_cached_block(1, b"h") is b


def test_shared_block_needs_one_free_per_holder():
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.touch([b, p.null_block])
    assert b.ref_cnt == 2 and p.null_block.ref_cnt == 0
    p.free([b])
    assert p.num_free_blocks == 1
    p.free([b, p.null_block])
    assert p.num_free_blocks == 2
    with pytest.raises(IntegrityError, match="freed more often"):
        p.free([b])  # a real exception, `python -O` or not: the block stays free once
    assert b.ref_cnt == 0 and p.num_free_blocks == 2


def test_a_cached_block_is_never_refiled_under_another_hash():
    """A caller passing a prefix-hit block with another hash would file one block's content
    under two prefixes; refused, `python -O` or not."""
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)  # the same hash again: a prefix hit, kept
    with pytest.raises(IntegrityError, match="asked to cache it as"):
        p.cache_full_blocks(0, [b], [b"other"], 0, 1, BS)
    with pytest.raises(IntegrityError, match="in group 1"):
        p.cache_full_blocks(1, [b], [b"h"], 0, 1, BS)
    assert p.get_cached_block(0, b"h") is b and p.get_cached_block(0, b"other") is None


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    p = pool(4)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)
    p.free([b])
    assert p.free_queue.block_ids() == [2, 3, 1]
    p.touch([p.get_cached_block(0, b"h")])
    assert p.free_queue.block_ids() == [2, 3] and b.ref_cnt == 1
    p.check_integrity()


def test_usage_excludes_the_null_block():
    p = pool(5)
    p.get_new_blocks(3)
    assert p.usage == pytest.approx(0.75)


def test_reset_prefix_cache_refuses_while_any_block_is_in_use():
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)
    assert p.reset_prefix_cache() is False
    assert p.get_cached_block(0, b"h") is b
    p.free([b])
    assert p.reset_prefix_cache() is True
    assert p.get_cached_block(0, b"h") is None and b.block_hash is None


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: setattr(p.blocks[3], "ref_cnt", 1), "in the free queue with references"),
        (lambda p: setattr(p.blocks[1], "ref_cnt", 0), "misfiled"),
        (lambda p: setattr(p.blocks[1], "block_hash", b"x"), "not in the map"),
        (lambda p: setattr(p.free_queue, "num_free_blocks", 9), "free count"),
        (lambda p: setattr(p, "num_quarantined_refs", 5), "quarantine ref count"),
        (lambda p: setattr(p, "processed_step_seq", 10), "past its stamp"),
        (lambda p: setattr(p, "_num_cached", 1), "cached block count drifted"),
    ],
)
def test_check_integrity_names_the_broken_invariant(corrupt, message):
    p = pool(5)
    _, b = p.get_new_blocks(2)
    p.free([b], last_step_seq=3)  # quarantined: ref kept
    p.check_integrity()
    corrupt(p)
    with pytest.raises(IntegrityError, match=message):
        p.check_integrity()


def test_check_integrity_still_raises_under_python_O():
    """`python -O` strips asserts; the integrity check raises explicitly, so it still catches a
    corrupted pool there (the check stays usable in optimised debug runs)."""
    code = textwrap.dedent(
        """
        from kvtier.kv import BlockPool, IntegrityError
        p = BlockPool(5)
        p.get_new_blocks(1)[0].ref_cnt = 0  # a block neither held nor in the free queue
        try:
            p.check_integrity()
        except IntegrityError as e:
            print("raised:", e)
        """
    )
    run = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120
    )
    if run.returncode != 0 or "raised:" not in run.stdout or "misfiled" not in run.stdout:
        pytest.fail(f"no IntegrityError under -O: rc {run.returncode}, {run.stdout}{run.stderr}")


# ---- quarantine ----------------------------------------------------------------------------------


def test_quarantined_block_is_never_allocated_until_its_stamp_is_processed():
    p = pool(6)
    held = p.get_new_blocks(3)
    p.free(held, last_step_seq=5)
    assert p.num_free_blocks == 2 and p.usage == pytest.approx(0.6)
    assert sorted(p.quarantined_block_ids()) == ids(held)
    rest = p.get_new_blocks(p.num_free_blocks)  # take everything allocatable
    assert not set(ids(rest)) & set(ids(held))
    with pytest.raises(ValueError):
        p.get_new_blocks(1)
    assert p.release_quarantine(4) == 0
    assert p.num_free_blocks == 0 and all(b.ref_cnt == 1 for b in held)
    p.check_integrity()
    assert p.release_quarantine(5) == 3
    assert p.num_free_blocks == 3 and p.quarantined_block_ids() == []
    assert sorted(ids(p.get_new_blocks(3))) == ids(held)
    p.check_integrity()


def test_free_stamped_with_a_processed_step_is_immediate():
    p = pool(4)
    p.release_quarantine(7)
    a, b = p.get_new_blocks(2)
    p.free([a], last_step_seq=7)
    p.free([b], last_step_seq=None)
    assert p.num_free_blocks == 3 and p.num_quarantined_refs == 0


def test_quarantine_off_frees_immediately_whatever_the_stamp():
    p = pool(4, enable_quarantine=False)
    blocks = p.get_new_blocks(3)
    p.free(blocks, last_step_seq=100)
    assert p.num_free_blocks == 3 and p.quarantined_block_ids() == []
    p.check_integrity()


def test_quarantine_releases_by_stamp_then_free_order_and_never_regresses():
    p = pool(6)
    a, b, c = p.get_new_blocks(3)
    p.free([a], last_step_seq=3)
    p.free([b], last_step_seq=2)
    p.free([c], last_step_seq=3)
    assert p.release_quarantine(2) == 1
    assert p.free_queue.block_ids() == [b.block_id, 4, 5]
    assert p.release_quarantine(1) == 0 and p.processed_step_seq == 2
    assert p.release_quarantine(3) == 2
    # both stamp-3 entries released in free order, each prepended (fresh): c ends at the head
    assert p.free_queue.block_ids() == [c.block_id, a.block_id, b.block_id, 4, 5]
    p.check_integrity()


def test_quarantine_counts_each_reference_separately():
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.touch([b])
    p.free([b], last_step_seq=1)
    p.free([b], last_step_seq=2)
    assert p.quarantined_block_ids() == [b.block_id, b.block_id] and p.num_quarantined_refs == 2
    p.release_quarantine(1)
    assert b.ref_cnt == 1 and p.num_free_blocks == 1
    p.release_quarantine(2)
    assert b.ref_cnt == 0 and p.num_free_blocks == 2
    p.check_integrity()


def test_freeable_quarantined_blocks_exclude_blocks_with_live_holders():
    p = pool(6)
    a, b, c = p.get_new_blocks(3)
    p.touch([b, c])
    p.free([a, b, c], last_step_seq=2)  # a: only holder; b, c still held elsewhere
    assert p.num_quarantined_refs == 3 and p.num_quarantined_freeable() == 1
    p.free([c], last_step_seq=3)  # now both of c's references are quarantined
    assert p.num_quarantined_freeable() == 2
    p.release_quarantine(3)
    assert p.num_quarantined_freeable() == 0 and p.num_free_blocks == 4


def test_hashed_quarantined_block_stays_a_prefix_hit_and_its_new_holder_survives_release():
    """Documented choice (BlockPool docstring): a hashed block's tokens are final, so a new
    holder only adds later compute-stream reads; its reference outlives the quarantine's."""
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)
    p.free([b], last_step_seq=4)
    assert p.get_cached_block(0, b"h") is b
    p.touch([p.get_cached_block(0, b"h")])
    assert b.ref_cnt == 2
    assert p.release_quarantine(4) == 1
    assert b.ref_cnt == 1 and b.block_id not in p.free_queue.block_ids()
    assert ids(p.get_new_blocks(1)) == [2]
    with pytest.raises(ValueError):
        p.get_new_blocks(1)
    p.free([b])
    assert p.free_queue.block_ids() == [b.block_id] and b.block_hash == b"h"
    p.check_integrity()


def test_reset_prefix_cache_refuses_while_blocks_are_quarantined():
    p = pool(3)
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks(0, [b], [b"h"], 0, 1, BS)
    p.free([b], last_step_seq=1)
    assert p.reset_prefix_cache() is False
    p.release_quarantine(1)
    assert p.reset_prefix_cache() is True
