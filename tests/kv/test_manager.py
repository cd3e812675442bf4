"""KVCacheManager facade: lookup, atomic allocation, lookahead, external tokens, caching bounds,
stats, events, reset, quarantine, and admission with the shared transient reserve (scenarios 18-19).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.kv import (
    BlockRemoved,
    BlockStored,
    ChunkedLocal,
    FullAttention,
    IntegrityError,
    KVCacheManager,
    KVSpec,
    Mamba,
    SlidingWindow,
    cdiv,
)
from tests.kv.factories import admit, fresh_tokens, ids, manager

BS = 16


def snapshot(m: KVCacheManager) -> tuple:
    """Everything an allocation may change."""
    p = m.pool
    return (
        p.free_queue.block_ids(),
        [b.ref_cnt for b in p.blocks],
        [b.block_hash for b in p.blocks],
        {
            g: {r: ids(t) for r, t in mgr.req_to_blocks.items()}
            for g, mgr in enumerate(m.coordinator.managers)
        },
        [mgr.num_excess_blocks for mgr in m.coordinator.managers],
        p.num_cached_entries(),
    )


# ---- lookup and stats ----------------------------------------------------------------------------


def test_lookup_touches_nothing_and_counts_nothing_record_lookup_counts():
    m = manager(11)
    tokens = fresh_tokens(40)
    admit(m, "a", tokens)
    m.free("a")
    before = snapshot(m)
    seq = m.new_sequence("b", [*tokens[:33], 1, 2])
    hits, num_hit = m.get_computed_blocks(seq)
    assert num_hit == 32 and all(b.ref_cnt == 0 for b in hits[0])
    assert m.get_computed_blocks(seq)[1] == 32  # a retry: still nothing counted
    assert snapshot(m) == before and m.stats.num_requests == 0
    m.record_lookup(m.new_sequence("a", tokens), 0, preempted=False)
    m.record_lookup(seq, num_hit, preempted=False)
    assert (m.stats.num_requests, m.stats.num_query_tokens, m.stats.num_hit_tokens) == (2, 75, 32)
    assert m.stats.hit_rate == pytest.approx(32 / 75)
    m.record_lookup(seq, 16, preempted=True)  # a re-admission after preemption: apart
    assert (m.stats.num_requests, m.stats.num_preempted_requests) == (2, 1)
    assert m.stats.num_preempted_hit_tokens == 16 and m.stats.hit_rate == pytest.approx(32 / 75)


def test_lookup_with_caching_disabled_finds_nothing_and_counts_nothing():
    m = manager(11, enable_caching=False)
    tokens = fresh_tokens(40)
    admit(m, "a", tokens)
    m.free("a")
    seq = m.new_sequence("b", tokens)
    assert m.get_computed_blocks(seq) == ([[]], 0)
    m.record_lookup(seq, 0, preempted=False)
    assert m.stats.num_requests == 0 and m.stats.hit_rate == 0.0


def test_hit_length_is_capped_by_max_model_len():
    m = manager(11, max_model_len=40)
    tokens = fresh_tokens(64)
    seq = m.new_sequence("a", tokens)
    assert m.allocate_slots(seq, 40) is not None
    assert len(m.get_blocks("a")[0]) == 3  # 40 tokens: the cap, not the 64-token prompt
    m.free("a")
    assert m.get_computed_blocks(m.new_sequence("b", tokens))[1] == 32


# ---- allocate_slots ------------------------------------------------------------------------------


def test_failed_allocation_of_a_hybrid_request_with_hits_changes_nothing():
    m = manager(15, [FullAttention(BS), SlidingWindow(BS, 32)])
    admit(m, "filler", fresh_tokens(48))  # 6 of 14 blocks held for good
    tokens = fresh_tokens(64)
    admit(m, "a", tokens)
    m.free("a")  # 8 free blocks, all cached
    seq = m.new_sequence("b", [*tokens, *fresh_tokens(40)])
    hits, num_hit = m.get_computed_blocks(seq)
    assert num_hit == 64
    before = snapshot(m)
    # full: 3 new + 4 evictable hits; window: 3 new + 2 evictable hits (s2, s3) = 12 > 8
    assert (
        m.allocate_slots(seq, 40, num_new_computed_tokens=num_hit, new_computed_blocks=hits) is None
    )
    assert snapshot(m) == before
    assert not m.coordinator.has_request("b")
    m.check_integrity()


def test_successful_allocation_installs_hits_then_allocates_new_blocks():
    m = manager(20, [FullAttention(BS), SlidingWindow(BS, 32)])
    tokens = fresh_tokens(64)
    admit(m, "a", tokens)
    m.free("a")
    seq = m.new_sequence("b", [*tokens, *fresh_tokens(40)])
    hits, num_hit = m.get_computed_blocks(seq)
    new = m.allocate_slots(seq, 40, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert new is not None and [len(g) for g in new] == [3, 3]
    full, swa = m.get_blocks("b")
    assert full[:4] == hits[0] and all(b.ref_cnt == 1 for b in full)
    assert [b.is_null for b in swa] == [True, True, False, False, False, False, False]
    m.check_integrity()


def test_allocate_slots_rejects_bad_token_counts():
    m = manager(11)
    seq = m.new_sequence("a", fresh_tokens(8))
    with pytest.raises(ValueError, match="≥ 0"):
        m.allocate_slots(seq, -1)
    with pytest.raises(ValueError, match="≥ 0"):
        m.allocate_slots(seq, 4, num_lookahead_tokens=-1)
    with pytest.raises(ValueError, match="new tokens or externally computed"):
        m.allocate_slots(seq, 0)


def test_lookahead_allocates_room_for_drafts_but_never_caches_them():
    m = manager(11)
    seq = m.new_sequence("a", fresh_tokens(30))
    new = m.allocate_slots(seq, 30, num_lookahead_tokens=3)
    assert new is not None and len(new[0]) == 3  # cdiv(33, 16)
    assert [b.block_hash is not None for b in m.get_blocks("a")[0]] == [True, False, False]
    seq.num_computed_tokens = 30
    seq.append_output_token_ids(fresh_tokens(2))
    assert m.allocate_slots(seq, 2, num_lookahead_tokens=3) == [[]]  # 35 tokens: 3 blocks
    assert m.get_blocks("a")[0][1].block_hash == seq.block_hashes[1]
    assert m.get_blocks("a")[0][2].block_hash is None


def test_lookahead_is_capped_by_max_model_len():
    m = manager(11, max_model_len=32)
    seq = m.new_sequence("a", fresh_tokens(30))
    new = m.allocate_slots(seq, 30, num_lookahead_tokens=5)
    assert new is not None and len(new[0]) == 2


def test_caching_stops_at_known_tokens_not_scheduled_placeholders():
    m = manager(11)
    seq = admit(m, "a", fresh_tokens(31))
    assert m.pool.num_cached_entries() == 1
    assert m.allocate_slots(seq, 1) == [[]]  # output placeholder at 31: token not known yet
    assert m.pool.num_cached_entries() == 1
    seq.num_computed_tokens = 32
    seq.append_output_token_ids([7])
    m.allocate_slots(seq, 1)
    assert m.pool.num_cached_entries() == 2


def test_prefill_chunks_cache_only_their_full_blocks():
    m = manager(11)
    seq = m.new_sequence("a", fresh_tokens(40))
    m.allocate_slots(seq, 20)
    assert m.pool.num_cached_entries() == 1
    seq.num_computed_tokens = 20
    m.allocate_slots(seq, 20)
    assert m.pool.num_cached_entries() == 2


def test_delayed_caching_publishes_only_on_cache_blocks():
    m = manager(11)
    seq = m.new_sequence("a", fresh_tokens(40))
    m.allocate_slots(seq, 40, delay_cache_blocks=True)
    assert m.pool.num_cached_entries() == 0
    m.cache_blocks(seq, 40)
    assert m.pool.num_cached_entries() == 2


def test_external_tokens_get_fresh_blocks_after_local_hits():
    m = manager(11)
    tokens = fresh_tokens(70)
    admit(m, "a", tokens[:33])
    m.free("a")
    seq = m.new_sequence("b", tokens)
    hits, num_hit = m.get_computed_blocks(seq)
    assert num_hit == 32
    new = m.allocate_slots(
        seq,
        5,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_external_computed_tokens=16,
        delay_cache_blocks=True,
    )
    assert new is not None and len(new[0]) == 2  # cdiv(32 + 16 + 5, 16) = 4 positions, 2 hits
    assert m.get_blocks("b")[0][:2] == hits[0]
    assert m.pool.num_cached_entries() == 2  # loaded blocks are published only after the load


def test_external_tokens_only_allocation_for_a_waiting_remote_request():
    m = manager(11)
    seq = m.new_sequence("a", fresh_tokens(50))
    new = m.allocate_slots(seq, 0, num_external_computed_tokens=48, delay_cache_blocks=True)
    assert new is not None and len(new[0]) == 3
    assert m.pool.num_cached_entries() == 0


def test_external_tokens_past_the_window_allocate_only_in_window_blocks():
    m = manager(20, [FullAttention(BS), SlidingWindow(BS, 32)])
    seq = m.new_sequence("a", fresh_tokens(100))
    new = m.allocate_slots(seq, 4, num_external_computed_tokens=96)
    assert new is not None and [len(g) for g in new] == [7, 7]  # window: skipped(96) = 65 → 4 null
    assert [b.is_null for b in new[1]] == [b.is_null for b in m.get_blocks("a")[1]]
    assert [b.is_null for b in m.get_blocks("a")[1]] == [True] * 4 + [False] * 3
    m.check_integrity()


def test_failed_allocation_does_not_prune():
    """Deliberate difference (b): vLLM prunes inside allocate_slots, so a failed allocation has
    already freed out-of-window blocks. Ours prunes only in remove_skipped_blocks on the settled
    count, so a refused allocate_slots leaves the tables exactly as they were."""
    m = manager(10, [SlidingWindow(BS, 32)])
    seq = admit(m, "a", fresh_tokens(64))
    admit(m, "filler", fresh_tokens(64))  # 1 of 9 blocks left; growing "a" to 104 needs 3
    before = snapshot(m)
    seq.append_output_token_ids(fresh_tokens(40))
    assert m.allocate_slots(seq, 40) is None
    assert snapshot(m) == before
    assert m.remove_skipped_blocks("a", 64) == 2
    assert m.allocate_slots(seq, 40) is not None
    m.check_integrity()


def test_prune_uses_the_settled_count_not_the_scheduled_one():
    m = manager(30, [SlidingWindow(BS, 32)])
    seq = m.new_sequence("a", fresh_tokens(200))
    m.allocate_slots(seq, 100)
    seq.num_computed_tokens = 100
    assert m.remove_skipped_blocks("a", 40, last_step_seq=1) == 0  # skipped(40) = 9 tokens
    assert m.remove_skipped_blocks("a", 64, last_step_seq=1) == 2  # skipped(64) = 33 tokens
    assert [b.is_null for b in m.get_blocks("a")[0]] == [True, True] + [False] * 5
    m.check_integrity()


# ---- events and reset ----------------------------------------------------------------------------


def test_events_name_each_group_and_report_evictions():
    m = manager(9, [FullAttention(BS), SlidingWindow(BS, 32)], enable_kv_events=True)
    tokens = fresh_tokens(33)
    seq = admit(m, "a", tokens)
    assert m.take_events() == [
        BlockStored(seq.block_hashes, None, tokens[:32], BS, 0, "device"),
        BlockStored(seq.block_hashes, None, tokens[:32], BS, 1, "device"),
    ]
    m.free("a")
    admit(m, "b", fresh_tokens(64))  # 4 blocks per group: takes all 8, evicting the 4 cached
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted((e.group_id, e.block_hashes[0]) for e in removed) == sorted(
        (g, h) for g in (0, 1) for h in seq.block_hashes
    )


def test_reset_prefix_cache_through_the_facade():
    m = manager(11)
    tokens = fresh_tokens(40)
    admit(m, "a", tokens)
    assert m.reset_prefix_cache() is False
    m.free("a", last_step_seq=1)
    assert m.reset_prefix_cache() is False  # quarantined blocks are still in use
    m.release_quarantine(1)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(m.new_sequence("b", tokens))[1] == 0


# ---- quarantine through the facade ---------------------------------------------------------------


def test_finished_request_blocks_are_not_reallocated_before_its_last_step_is_processed():
    m = manager(11)
    a = admit(m, "a", fresh_tokens(64))
    held = set(m.get_block_ids("a")[0])
    m.free("a", last_step_seq=3)
    m.check_integrity()
    assert m.num_free_blocks == 6 and m.usage == pytest.approx(0.4)
    big = m.new_sequence("big", fresh_tokens(160))
    assert m.allocate_slots(big, 160) is None  # needs all 10 blocks
    got = m.allocate_slots(big, 96)
    assert got is not None and not held & set(ids(got[0]))
    m.release_quarantine(2)
    assert m.num_free_blocks == 0
    assert m.release_quarantine(3) == 4 and m.num_free_blocks == 4
    assert a.num_computed_tokens == 64
    m.check_integrity()


def test_pruned_window_blocks_wait_in_quarantine():
    m = manager(30, [SlidingWindow(BS, 32)])
    seq = m.new_sequence("a", fresh_tokens(200))
    m.allocate_slots(seq, 100)
    free = m.num_free_blocks
    assert m.remove_skipped_blocks("a", 100, last_step_seq=5) == 4
    assert m.num_free_blocks == free and m.pool.num_quarantined_refs == 4
    m.check_integrity()
    m.release_quarantine(5)
    assert m.num_free_blocks == free + 4
    m.check_integrity()


def test_quarantined_cached_blocks_remain_prefix_hits_and_are_not_charged():
    m = manager(11)
    tokens = fresh_tokens(64)
    admit(m, "a", tokens)
    m.free("a", last_step_seq=2)
    seq = m.new_sequence("b", [*tokens, 9])
    hits, num_hit = m.get_computed_blocks(seq)
    assert num_hit == 64
    assert m.coordinator.num_blocks_to_allocate("b", 65, hits, 64) == 1  # hits have refs
    assert (
        m.allocate_slots(seq, 1, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
        is not None
    )
    m.check_integrity()
    m.release_quarantine(2)
    assert [b.ref_cnt for b in m.get_blocks("b")[0]] == [1] * 5
    assert m.num_free_blocks == 5
    m.check_integrity()


def test_quarantine_off_frees_at_once_through_the_facade():
    m = manager(11, enable_quarantine=False)
    admit(m, "a", fresh_tokens(64))
    m.free("a", last_step_seq=99)
    assert m.num_free_blocks == 10


def test_check_integrity_accounts_for_pins_held_outside_the_tables():
    m = manager(11)
    admit(m, "a", fresh_tokens(32))
    block = m.get_blocks("a")[0][0]
    m.pool.touch([block])  # e.g. a transfer pins it
    with pytest.raises(IntegrityError, match="1 holders"):
        m.check_integrity()
    m.check_integrity(num_pinned={block.block_id: 1})


def test_check_integrity_names_an_admission_charge_dropped_while_its_table_lives():
    m = manager(11)
    admit(m, "a", fresh_tokens(32))
    m.check_integrity()
    m.charges.release("a")  # out of order: `free` releases the charge with the table
    with pytest.raises(IntegrityError, match=r"a table without a charge \['a'\]"):
        m.check_integrity()


# ---- admission with the shared transient reserve -------------------------------------------------


def swa_manager(num_free: int, window: int, max_in_flight: int, **kw) -> KVCacheManager:
    return KVCacheManager(
        [SlidingWindow(BS, window)],
        num_free + 1,
        max_model_len=kw.pop("max_model_len", 16384),
        max_in_flight_tokens=max_in_flight,
        **kw,
    )


def test_reserve_is_pool_wide_and_grows_by_one_block_per_request():
    m = swa_manager(1000, 512, 1024)
    assert m.reserve_shortfall(1) == 64 + 1
    for i in range(3):
        admit(m, f"r{i}", fresh_tokens(512))  # 32 blocks each: within the steady 33
    assert m.reserve_shortfall(0) == 64 + 3
    assert m.reserve_shortfall(1) == 64 + 4


def test_blocks_beyond_the_steady_charge_and_quarantined_refs_count_as_held_reserve():
    m = swa_manager(1000, 512, 1024)
    seq = m.new_sequence("a", fresh_tokens(2000))
    m.allocate_slots(seq, 1024)  # 64 blocks: 31 beyond the steady cdiv(511, 16) + 1 = 33
    assert m.coordinator.managers[0].num_excess_blocks == 31
    assert m.reserve_shortfall(1) == 66 - 31
    assert m.remove_skipped_blocks("a", 1024, last_step_seq=1) == 32  # skipped 513 tokens
    assert m.coordinator.managers[0].num_excess_blocks == 0
    assert m.reserve_shortfall(1) == 66 - 32  # the 32 quarantined refs are in flight
    m.release_quarantine(1)
    assert m.reserve_shortfall(1) == 66
    m.check_integrity()


def test_quarantined_refs_of_shared_blocks_do_not_stand_in_for_the_reserve():
    """Bug fixed here: reserve_shortfall counted every quarantined reference as held reserve, but
    a finished request's references to prefix blocks another request still holds free nothing
    when released. Admitting on that credit left the pool short of the reserve afterwards."""
    m = KVCacheManager(
        [FullAttention(BS), SlidingWindow(BS, 32)], 40, max_model_len=4096, max_in_flight_tokens=64
    )
    prefix = fresh_tokens(64)
    admit(m, "a", [*prefix, *fresh_tokens(16)])
    admit(m, "b", [*prefix, *fresh_tokens(16)])  # shares 4 full + 2 window blocks with "a"
    m.free("a", last_step_seq=1)
    assert m.pool.num_quarantined_refs == 10 and m.pool.num_quarantined_freeable() == 4
    i = 0
    while m.allocate_slots(m.new_sequence(f"c{i}", fresh_tokens(16)), 16) is not None:
        i += 1
    m.release_quarantine(1)
    assert m.reserve_shortfall() <= m.num_free_blocks
    m.check_integrity()


def test_no_reserve_without_in_flight_tokens_or_window_groups():
    assert swa_manager(100, 512, 0).reserve_shortfall(5) == 0
    full = KVCacheManager([FullAttention(BS)], 100, max_model_len=4096, max_in_flight_tokens=4096)
    assert full.reserve_shortfall(5) == 0


def test_new_request_is_refused_unless_the_reserve_stays_free_but_running_ones_grow_into_it():
    m = swa_manager(100, 512, 1024)
    a = admit(m, "a", fresh_tokens(512))  # 32 blocks; 68 free; reserve now 64 + 1
    b = m.new_sequence("b", fresh_tokens(16))  # 1 block + reserve for 2 requests = 67
    assert m.allocate_slots(b, 16) is not None  # 68 ≥ 67
    c = m.new_sequence("c", fresh_tokens(16))  # 1 + 64 + 3 = 68 > 67 free
    before = snapshot(m)
    assert m.allocate_slots(c, 16) is None
    assert snapshot(m) == before
    a.append_output_token_ids(fresh_tokens(512))
    assert m.allocate_slots(a, 512) is not None  # running: grows into the reserve
    assert m.num_free_blocks == 67 - 32
    m.check_integrity()


@pytest.mark.parametrize(
    ("spec", "max_in_flight", "max_model_len", "vllm_cap", "ours_one"),
    [
        (SlidingWindow(BS, 1024), 1024, 16384, 129, 65 + 65),
        (SlidingWindow(BS, 1024), 2048, 16384, 193, 65 + 129),
        (ChunkedLocal(BS, 1024), 1024, 16384, 128, 64 + 65),
        (ChunkedLocal(BS, 1024), 2048, 16384, 192, 64 + 129),
        (SlidingWindow(BS, 1024), 2048, 2000, 126, 125),  # reserve capped: the whole table
        (SlidingWindow(BS, 512), 1024, 16384, 97, 33 + 65),  # B = 512, async depth 2
        (SlidingWindow(BS, 512), 512, 16384, 65, 33 + 33),  # B = 512, sync
    ],
)
def test_admission_charge_steady_per_request_plus_one_shared_reserve(
    spec, max_in_flight, max_model_len, vllm_cap, ours_one
):
    """Scenario 18, deliberate difference (a). vLLM charges every request
    cdiv(min(W − 1 + in_flight, max_model_len), bs) + 1 (chunked: cdiv(min(C + in_flight, ...))).
    We charge cdiv(W − 1, bs) + 1 per request (chunked: cdiv(C, bs)) plus one pool-wide reserve
    cdiv(in_flight, bs) + requests. A lone request costs us one block more (the reserve's
    per-request boundary block) — but never more than its whole table (max_model_len 2000: 125
    blocks, one fewer than vLLM); every further request costs only its steady part, so at 10,000
    blocks we admit about twice as many."""
    if isinstance(spec, SlidingWindow):
        vllm = cdiv(min(spec.window - 1 + max_in_flight, max_model_len), BS) + 1
    else:
        vllm = cdiv(min(spec.chunk + max_in_flight, max_model_len), BS)
    assert vllm == vllm_cap  # the scenario's numbers, from vLLM's formula
    m = KVCacheManager(
        [spec], 10_001, max_model_len=max_model_len, max_in_flight_tokens=max_in_flight
    )
    assert m.blocks_for_requests(1, max_model_len) == ours_one
    ours, theirs = m.max_concurrency(), 10_000 // vllm
    assert m.blocks_for_requests(ours, max_model_len) <= 10_000
    assert m.blocks_for_requests(ours + 1, max_model_len) > 10_000
    assert ours >= 1.5 * theirs


def test_max_length_requests_admitted_on_a_gemma_like_hybrid_vs_vllm():
    """architecture.md §Admission: 1 full + 5 SWA groups (W 1024, bs 16), B 8192 at async depth 2,
    max_model_len 16384. vLLM (post-#47728) charges 1024 + 5 × 1025 blocks per request; we charge
    1024 + 5 × 65 per request plus 5 × (1024 + requests) once."""
    specs = [FullAttention(BS)] + [SlidingWindow(BS, 1024)] * 5
    m = KVCacheManager(specs, 100_001, max_model_len=16384, max_in_flight_tokens=16384)
    vllm_per_request = 1024 + 5 * (cdiv(min(1023 + 16384, 16384), BS) + 1)
    assert vllm_per_request == 6149
    assert m.blocks_for_requests(10, 16384) == 10 * (1024 + 5 * 65) + 5 * (1024 + 10)
    assert 100_000 // vllm_per_request == 16
    assert m.max_concurrency() == (100_000 - 5 * 1024) // (1024 + 5 * 65 + 5) == 70


@pytest.mark.parametrize(
    ("max_in_flight", "num_free", "admitted"),
    [(1024, 100, True), (1024, 97, True), (1024, 96, False), (512, 70, True), (1024, 70, False)],
    ids=["async-100", "async-97", "async-96", "sync-70", "async-70"],
)
def test_long_request_admission_gate_under_async_and_sync(max_in_flight, num_free, admitted):
    """Scenario 19: SWA W=512, bs 16, B 512, a 16,000-token fresh prompt, its first 512-token
    chunk. Our gate is the chunk's 32 blocks plus the shared reserve for one request
    (async 64 + 1, sync 32 + 1): 97 and 65, the same thresholds as vLLM's per-request caps, so
    the admit/refuse outcomes carry over unchanged."""
    m = swa_manager(num_free, 512, max_in_flight)
    seq = m.new_sequence("long", fresh_tokens(16_000))
    assert (m.allocate_slots(seq, 512) is not None) == admitted
    assert m.coordinator.has_request("long") == admitted


def test_max_concurrency_for_a_shorter_length_is_what_admission_admits():
    """A 100-token request never holds more than its 7 blocks, but admission cannot know that it
    stays short: the pool keeps the reserve max-length requests could need (64 + 1 per request),
    and the formula at 100 tokens counts it too."""
    m = swa_manager(1000, 512, 1024)
    n = m.max_concurrency(100)
    assert n == (1000 - 64) // (7 + 1)
    admitted = 0
    while m.allocate_slots(m.new_sequence(f"r{admitted}", fresh_tokens(100)), 100) is not None:
        admitted += 1
    assert admitted == n
    assert swa_manager(10, 512, 1024).max_concurrency() == 0


def test_request_whose_whole_table_fits_is_admitted_despite_a_large_in_flight_budget():
    """W 64, bs 16, max_model_len 256, in-flight 1024: a request never holds more than 16 blocks,
    yet admission asks for 16 + cdiv(1024, 16) + 1 = 81 of the 40 free blocks — forever."""
    m = swa_manager(40, 64, 1024, max_model_len=256)
    assert m.max_concurrency() >= 1
    seq = m.new_sequence("a", fresh_tokens(256))
    assert m.allocate_slots(seq, 256) is not None


# ---- the sizing formula is enough: n sized requests run to completion ----------------------------


def run_sized_pool(
    specs: list[KVSpec], n: int, prompt: int, decode: int, budget: int, depth: int
) -> tuple[int, int, int]:
    """Size the pool with `blocks_for_requests(n, prompt + decode)` and run n requests through it.

    Each step every request gets up to ceil(budget / n) tokens (waiting ones are admitted when
    allocate_slots allows); step k is processed once step k + depth − 1 is scheduled; processing
    appends the sampled token, prunes on the settled count and frees finished requests (stamped
    with the processed step, as the scheduler's settled basis does). Returns (allocation failures
    of running requests, requests finished, most requests running at once)."""
    length, in_flight = prompt + decode, budget * depth
    probe = KVCacheManager(specs, 2, max_model_len=length, max_in_flight_tokens=in_flight)
    m = KVCacheManager(
        specs,
        probe.blocks_for_requests(n, length) + 1,
        max_model_len=length,
        max_in_flight_tokens=in_flight,
    )
    assert m.max_concurrency() >= n
    waiting = [m.new_sequence(f"r{i}", fresh_tokens(prompt)) for i in range(n)]
    running: list = []
    settled = {r.request_id: 0 for r in waiting}
    steps: list[dict] = []
    failures = most = processed = 0
    share = cdiv(budget, n)
    while (running or waiting) and len(steps) < 10_000:
        left, step = budget, {}
        for r in running:
            want = r.num_tokens - r.num_computed_tokens or 1  # prefill chunk, else one decode
            c = min(left, share, want, length - r.num_computed_tokens)
            if c > 0 and m.allocate_slots(r, c) is None:
                failures += 1
            elif c > 0:
                r.num_computed_tokens += c
                left -= c
                step[r.request_id] = (r, c)
        while waiting and min(left, share) > 0:
            r, c = waiting[0], min(left, share, prompt)
            if m.allocate_slots(r, c) is None:
                break
            running.append(waiting.pop(0))
            r.num_computed_tokens += c
            left -= c
            step[r.request_id] = (r, c)
        steps.append(step)
        most = max(most, len(running))
        while processed < len(steps) and (len(steps) - processed >= depth or not step):
            for rid, (r, c) in steps[processed].items():
                settled[rid] += c
                if settled[rid] >= r.num_tokens and r.num_tokens < length:
                    r.append_output_token_ids(fresh_tokens(1))
                m.remove_skipped_blocks(rid, settled[rid], processed + 1)
                if settled[rid] >= length:
                    m.free(rid, processed + 1)
                    running.remove(r)
            processed += 1
            m.release_quarantine(processed)
            m.check_integrity()
    return failures, n - len(running) - len(waiting), most


@st.composite
def pruned_group_configs(draw: st.DrawFn) -> list[KVSpec]:
    bs = draw(st.sampled_from([4, 8, 16]))
    window = st.builds(SlidingWindow, st.just(bs), st.integers(1, 80))
    chunked = st.builds(ChunkedLocal, st.just(bs), st.integers(1, 6).map(lambda k: k * bs))
    other = draw(st.lists(st.one_of(window, chunked, st.just(Mamba(bs))), min_size=1, max_size=2))
    return ([FullAttention(bs)] if draw(st.booleans()) else []) + other


@given(
    specs=pruned_group_configs(),
    n=st.integers(1, 6),
    prompt=st.integers(1, 200),
    decode=st.integers(0, 30),
    budget=st.integers(1, 64),
    depth=st.integers(1, 3),
)
def test_pool_sized_by_the_formula_runs_every_request_without_a_growth_failure(
    specs, n, prompt, decode, budget, depth
):
    """Startup sizing, admission and the runtime agree: steady blocks per request plus the one
    shared reserve are enough for n concurrent requests of that length at any async depth
    (window, chunked-local and mamba groups, with or without a full-attention group)."""
    failures, finished, _ = run_sized_pool(specs, n, prompt, decode, budget, depth)
    assert failures == 0 and finished == n


def test_sized_pool_admits_all_requests_at_once():
    """The simulation really runs n requests side by side (else the property above is weak)."""
    failures, finished, most = run_sized_pool([SlidingWindow(16, 64)], 4, 300, 20, 64, 2)
    assert (failures, finished, most) == (0, 4, 4)


def test_mamba_pool_sized_by_the_formula_runs_at_async_depth_two():
    failures, finished, _ = run_sized_pool([Mamba(8)], 1, 148, 24, 6, 2)
    assert failures == 0 and finished == 1


# ---- construction and mixed block sizes ----------------------------------------------------------


def test_constructor_rejects_bad_lengths_and_hash_names():
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager([FullAttention(BS)], 8, max_model_len=0)
    with pytest.raises(ValueError, match="max_in_flight_tokens"):
        KVCacheManager([FullAttention(BS)], 8, max_model_len=64, max_in_flight_tokens=-1)
    with pytest.raises(ValueError, match="sha256"):
        KVCacheManager([FullAttention(BS)], 8, max_model_len=64, hash_fn="md5")


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
def test_mixed_block_sizes_round_trip_through_the_facade(hash_fn):
    """Hashes at gcd 16, hits at lcm 32; the coarse group caches its own 32-token view."""
    m = manager(
        40, [FullAttention(16), SlidingWindow(32, 64)], hash_fn=hash_fn, enable_kv_events=True
    )
    tokens = fresh_tokens(100)
    seq = admit(m, "a", tokens)
    assert len(seq.block_hashes) == 6
    events = m.take_events()
    assert [(e.group_id, len(e.block_hashes), e.block_size) for e in events] == [
        (0, 6, 16),
        (1, 3, 32),
    ]
    assert events[1].block_hashes == seq.block_hashes[1::2]
    assert events[1].token_ids == tokens[:96]
    m.free("a")
    hits, num_hit = m.get_computed_blocks(m.new_sequence("b", [*tokens[:80], 5]))
    assert num_hit == 64  # full reaches 80, rounded down to the 32-token alignment
    assert [len(h) for h in hits] == [4, 2]
    m.check_integrity()


def test_a_state_hit_alone_in_a_pool_sized_for_one_request_is_admitted():
    """A new request restored from a state snapshot holds the hit page and the page its first
    step writes: one page beyond its steady charge, its share of the transient reserve (not a
    second charge beside it). Found as an engine livelock: a preempted request with a 48-token
    hit never fitted an empty pool the plan had sized for one max-length request."""
    specs: list[KVSpec] = [FullAttention(8), Mamba(8), Mamba(8), Mamba(8)]
    max_in_flight = 16
    sized = KVCacheManager(specs, 2, max_model_len=64, max_in_flight_tokens=max_in_flight)
    m = manager(sized.blocks_for_requests(1, 64) + 1, specs, 64, max_in_flight_tokens=16)
    tokens = fresh_tokens(49)
    first = m.new_sequence("a", tokens)
    for n in (48, 1):  # a snapshot at 48
        assert m.allocate_slots(first, n) is not None
        first.num_computed_tokens += n
        m.cache_verified(first, first.num_computed_tokens)
    m.free("a")
    again = m.new_sequence("b", tokens)
    hits, num_hit = m.get_computed_blocks(again)
    assert num_hit == 48
    new = m.allocate_slots(again, 1, num_new_computed_tokens=48, new_computed_blocks=hits)
    assert new is not None, "the only request of a sized pool must fit"
    m.check_integrity()
