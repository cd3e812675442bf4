"""architecture.md §Scenarios group F (47–61) adapted to `HostTier`: device Pool(16), host pool of 8
blocks (7 usable) unless stated, block size 16, requests of k full blocks + 1 token.

Where kvtier differs from vLLM on purpose the test says so: stores planned from settled counts
(48), one transfer per request (50), chain-aware host eviction and targeted re-store (50, 60).
"""

from __future__ import annotations

import pytest

from kvtier.kv import BlockRemoved, SlidingWindow
from kvtier.sched.request import RequestStatus, StepRecord
from tests.offload.factories import (
    admit_with_load,
    check,
    device,
    host_has,
    request,
    run,
    settle_all,
    tier,
    tokens,
)


def test_47_eager_store_then_load_roundtrip_pins_until_completion():
    dev = device()
    t = tier(dev)
    toks = tokens(33)
    p = request(dev, "P", toks)
    run(dev, p)
    [store] = t.plan_stores([p])
    assert not store.is_load and len(store.src_block_ids) == len(store.dst_block_ids) == 2
    assert len(set(store.dst_block_ids)) == 2
    assert [dev.pool.blocks[i].ref_cnt for i in store.src_block_ids] == [2, 2]  # pinned +1
    check(dev, t)
    assert settle_all(t, [store]) == []
    assert host_has(t, p, [0, 1]) == [True, True]
    assert t.host.num_free == 7  # completed blocks are cached and free
    assert [dev.pool.blocks[i].ref_cnt for i in store.src_block_ids] == [1, 1]
    # P' with the same prompt and no device hit (its own device lookup is skipped: hit 0).
    p2 = request(dev, "P'", toks)
    assert t.lookup(p2, 0).num_tokens == 32
    assert (
        dev.allocate_slots(p2, 1, num_external_computed_tokens=32, delay_cache_blocks=True)
        is not None
    )
    load = t.plan_load(p2, 32)
    assert load is not None and load.is_load and load.num_blocks == 2
    assert [t.host.pool.blocks[i].ref_cnt for i in load.src_block_ids] == [1, 1]
    assert t.is_loading("P'")
    assert p2.status is RequestStatus.WAITING  # the tier decides; the scheduler parks requests
    check(dev, t)
    assert t.complete([load.transfer_id]) == ["P'"]
    assert not t.is_loading("P'")
    assert [t.host.pool.blocks[i].ref_cnt for i in load.src_block_ids] == [0, 0]
    assert t.metrics.num_loaded_blocks == 2 and t.metrics.num_stored_blocks == 2
    check(dev, t)


def test_48_stores_follow_the_settled_count_not_the_scheduled_one():
    """Deliberate difference: vLLM stores from computed − placeholders, which counts prefill
    chunks still executing (so its store depends on the compute event). kvtier stores only
    settled blocks: each store is planned after the step that wrote its blocks was processed."""
    dev = device()
    t = tier(dev)
    r = request(dev, "R", tokens(64))
    assert dev.allocate_slots(r, 32) is not None
    r.num_computed_tokens = 32
    r.ledger.append(StepRecord(1, 32, 0, 0))
    assert t.plan_stores([r]) == []  # step 1 in flight: nothing settled
    assert dev.allocate_slots(r, 32) is not None
    r.num_computed_tokens = 64
    r.ledger.append(StepRecord(2, 32, 0, 1))
    assert t.plan_stores([r]) == []  # step 2 scheduled, step 1 still unprocessed
    r.ledger.consume(1)
    [first] = t.plan_stores([r])
    assert first.src_block_ids == [b.block_id for b in dev.get_blocks("R")[0][:2]]
    r.ledger.consume(2)
    [second] = t.plan_stores([r])
    assert second.src_block_ids == [b.block_id for b in dev.get_blocks("R")[0][2:4]]
    assert t.plan_stores([r]) == []  # the absolute cursor is at 4
    check(dev, t)


def test_49_duplicate_store_is_skipped_and_the_cursor_advances():
    dev = device()
    t = tier(dev)
    toks = tokens(33)
    p = request(dev, "P", toks)
    run(dev, p)
    settle_all(t, t.plan_stores([p]))
    p2 = request(dev, "P2", toks)
    run(dev, p2)
    free_before = t.host.num_free
    assert t.plan_stores([p2]) == []
    assert t.host.num_free == free_before
    assert t.store_progress("P2").cursor == (2,)
    assert t.metrics.num_deduped_blocks == 2
    check(dev, t)


def test_50_host_lru_evicts_the_oldest_request_tail_first():
    """Same victim as vLLM (A, the least recently stored), but the chain's tail goes first:
    BlockRemoved lists a1 before a0 (deliberate: chain-aware insertion, architecture.md
    §Eviction)."""
    dev = device()
    t = tier(dev, 5, enable_kv_events=True)
    a, b, c = (request(dev, n, tokens(33)) for n in "ABC")
    for r in (a, b, c):
        run(dev, r)
    settle_all(t, t.plan_stores([a, b]))
    t.finish_request(a)  # finished: nothing to re-store (60b covers re-store)
    t.finish_request(b)
    t.host.pool.take_events()
    settle_all(t, t.plan_stores([c]))
    assert host_has(t, a, [0, 1]) == [False, False]
    assert host_has(t, b, [0, 1]) == [True, True]
    assert host_has(t, c, [0, 1]) == [True, True]
    removed = [e for e in t.host.pool.take_events() if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [a.block_hashes[1], a.block_hashes[0]]
    assert all(e.medium == "host" for e in removed)
    check(dev, t)


def test_51_a_lookup_pin_refreshes_host_lru():
    dev = device()
    t = tier(dev, 5)
    a, b, c = (request(dev, n, tokens(33)) for n in "ABC")
    for r in (a, b, c):
        run(dev, r)
    settle_all(t, t.plan_stores([a, b]))
    t.finish_request(a)
    t.finish_request(b)
    a2 = request(dev, "A2", a.all_token_ids)
    assert t.lookup(a2, 0).num_tokens == 32  # pins A's blocks
    assert t.plan_load(a2, 0) is None  # not taken: released to the MRU end
    settle_all(t, t.plan_stores([c]))
    assert host_has(t, b, [0, 1]) == [False, False]
    assert host_has(t, a, [0, 1]) == [True, True] and host_has(t, c, [0, 1]) == [True, True]
    check(dev, t)


def _stored_then_loading(num_host: int = 8):
    dev = device()
    t = tier(dev, num_host)
    toks = tokens(33)
    p = request(dev, "P", toks)
    run(dev, p)
    settle_all(t, t.plan_stores([p]))
    p2 = request(dev, "P'", toks)
    assert t.lookup(p2, 0).num_tokens == 32
    assert (
        dev.allocate_slots(p2, 1, num_external_computed_tokens=32, delay_cache_blocks=True)
        is not None
    )
    load = t.plan_load(p2, 32)
    assert load is not None
    return dev, t, p2, load


def test_52_finish_during_in_flight_load_keeps_pins_until_the_copy_completes():
    dev, t, p2, load = _stored_then_loading()
    t.finish_request(p2)
    dev.free("P'")  # the scheduler frees the table at once; the tier's pins keep the blocks
    assert [dev.pool.blocks[i].ref_cnt for i in load.dst_block_ids] == [1, 1]
    assert [t.host.pool.blocks[i].ref_cnt for i in load.src_block_ids] == [1, 1]
    check(dev, t)
    assert t.complete([load.transfer_id]) == []  # cancelled: not reported as loaded
    assert [dev.pool.blocks[i].ref_cnt for i in load.dst_block_ids] == [0, 0]
    host_free = t.host.pool.free_queue.block_ids()
    assert host_free[-2:] == sorted(load.src_block_ids, key=lambda i: -load.src_block_ids.index(i))
    check(dev, t)


def test_53_finish_during_in_flight_store_publishes_on_completion():
    dev = device()
    t = tier(dev)
    r = request(dev, "R", tokens(33))
    run(dev, r)
    stores = t.plan_stores([r])
    assert t.finish_request(r) == []  # everything settled was already planned
    dev.free("R")
    assert t.store_progress("R").finished and t.has_pending_stores
    check(dev, t)
    settle_all(t, stores)
    assert t.store_progress("R") is None and not t.has_pending_stores
    assert host_has(t, r, [0, 1]) == [True, True]
    check(dev, t)


def test_54_null_blocks_are_never_transferred():
    dev = device(specs=[SlidingWindow(16, 17)])
    t = tier(dev)
    toks = tokens(49)
    r = request(dev, "R", toks)
    run(dev, r)
    dev.remove_skipped_blocks("R", 48)  # positions 0, 1 fall out of the window
    table = dev.get_blocks("R")[0]
    assert [b.is_null for b in table] == [True, True, False, False]
    [store] = t.plan_stores([r])
    assert store.src_block_ids == [table[2].block_id]
    settle_all(t, [store])
    dev.free("R")
    dev.pool.evict_blocks(range(1, dev.pool.num_blocks))  # only the host tier has R's KV now
    q = request(dev, "Q", toks)
    load = admit_with_load(dev, t, q)
    assert load is not None and 0 not in load.src_block_ids + load.dst_block_ids
    assert load.num_blocks == 1
    check(dev, t)


def test_55_device_prefix_then_host_middle_then_new_tail():
    dev = device()
    t = tier(dev)
    toks = tokens(97)
    r = request(dev, "R", toks)
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    table = dev.get_blocks("R")[0]
    dev.free("R")
    dev.pool.evict_blocks([b.block_id for b in table[2:]])  # device keeps only h0, h1
    q = request(dev, "Q", toks)
    hits, num_hit = dev.get_computed_blocks(q)
    assert num_hit == 32
    assert t.lookup(q, num_hit).num_tokens == 64
    view = t.coordinator.group_hashes(q.block_hashes)[0]
    h4 = t.host.get((0, view[4]))
    assert h4 is not None and h4.ref_cnt == 1  # pinned by the pending hit
    assert t.lookup(q, num_hit, max_external_tokens=32).num_tokens == 32  # accept fewer
    assert h4.ref_cnt == 0  # the pins beyond the accepted boundary are released
    assert (
        dev.allocate_slots(
            q,
            33,
            num_new_computed_tokens=32,
            new_computed_blocks=hits,
            num_external_computed_tokens=32,
            delay_cache_blocks=True,
        )
        is not None
    )
    load = t.plan_load(q, 32)
    assert load is not None
    qt = dev.get_blocks("Q")[0]
    assert load.dst_block_ids == [qt[2].block_id, qt[3].block_id]
    assert load.src_block_ids == [t.host.get((0, view[i])).block_id for i in (2, 3)]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="offered"):
        t.plan_load(request(dev, "X", toks), 32)  # no lookup: nothing to load
    check(dev, t)


def test_56_a_transfer_completes_when_every_worker_reported_it():
    dev = device()
    t = tier(dev, world_size=2)
    r = request(dev, "R", tokens(33))
    run(dev, r)
    [store] = t.plan_stores([r])
    t.complete([store.transfer_id])
    assert host_has(t, r, [0, 1]) == [False, False] and t.device_pins()
    t.complete([store.transfer_id])
    assert host_has(t, r, [0, 1]) == [True, True] and not t.device_pins()
    check(dev, t)


def test_57_pending_hit_pin_is_taken_once_and_released_on_finish():
    dev = device()
    t = tier(dev)
    toks = tokens(33)
    r = request(dev, "R", toks)
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    q = request(dev, "Q", toks)
    t.lookup(q, 0)
    blocks = [t.host.get((0, h)) for h in q.block_hashes[:2]]
    assert [b.ref_cnt for b in blocks if b] == [1, 1]
    assert all(b.block_id not in t.host.pool.free_queue.block_ids() for b in blocks if b)
    t.lookup(q, 0)
    assert [b.ref_cnt for b in blocks if b] == [1, 1]  # no double pin
    t.finish_request(q)
    assert [b.ref_cnt for b in blocks if b] == [0, 0]
    check(dev, t)


def test_58_lazy_mode_stores_blocks_reaching_the_device_lru_head():
    dev = device(8)
    t = tier(dev, store_mode="lazy", lazy_scan_blocks=8)
    toks = tokens(33)
    x = request(dev, "X", toks)
    run(dev, x)
    x_blocks = [b.block_id for b in dev.get_blocks("X")[0][:2]]
    dev.free("X")
    filler = dev.pool.get_new_blocks(5)
    assert dev.pool.free_queue.block_ids() == x_blocks[::-1]
    [store] = t.plan_stores([])
    assert sorted(store.src_block_ids) == sorted(x_blocks)
    assert dev.pool.num_free_blocks == 0  # pinned for the copy
    settle_all(t, [store])
    assert sorted(dev.pool.free_queue.block_ids()) == sorted(x_blocks)  # back, at the tail
    assert host_has(t, x, [0, 1]) == [True, True]
    y = request(dev, "Y", [*toks, 7])
    assert t.lookup(y, 0).num_tokens == 32
    t.plan_load(y, 0)
    host_free = t.host.num_free
    assert t.plan_stores([]) == []  # same content again: no new host block
    assert t.host.num_free == host_free
    dev.pool.free(filler)
    check(dev, t)


def test_58b_lazy_scan_also_covers_the_blocks_that_move_up_while_candidates_are_copied():
    """Regression: the scan stopped after `lazy_scan_blocks` queue positions, but the candidates
    leave the queue for their copy, so the unscanned blocks behind them became the head and the
    next allocation evicted them unstored (in the engine: every shared prefix of a hybrid model
    lost from both tiers, 0 host hits). The scan now passes `lazy_scan_blocks` blocks that stay."""
    dev = device(16)
    t = tier(dev, 16, store_mode="lazy", lazy_scan_blocks=2)
    x = request(dev, "X", tokens(16 * 4 + 1))
    run(dev, x)
    x_blocks = [b.block_id for b in dev.get_blocks("X")[0][:4]]
    dev.free("X")
    filler = dev.pool.get_new_blocks(dev.pool.num_free_blocks - 4)
    assert sorted(dev.pool.free_queue.block_ids()) == sorted(x_blocks)  # all hashed, none stored
    [store] = t.plan_stores([])
    assert sorted(store.src_block_ids) == sorted(x_blocks)  # not just the first two
    settle_all(t, [store])
    head = dev.pool.get_new_blocks(2)  # the next allocation evicts only what the host holds
    assert host_has(t, x, [0, 1, 2, 3]) == [True] * 4
    dev.pool.free(head + filler)
    check(dev, t)


def test_58c_lazy_stores_never_evict_a_host_entry_the_device_still_caches():
    """Regression: with a host tier smaller than the device cache, each lazy store evicted host
    entries whose blocks were still cached on the device, so the next scan stored those again:
    an idle engine (no requests, draining its stores) stored and evicted the same blocks forever.
    """
    dev = device(16)
    t = tier(dev, 4, store_mode="lazy", lazy_scan_blocks=16)  # 3 usable host blocks
    x = request(dev, "X", tokens(16 * 6 + 1))
    run(dev, x)
    dev.free("X")  # 6 cached blocks in the device free queue, none on the host
    head = dev.pool.free_queue.block_ids()
    rounds = 0
    while stores := t.plan_stores([]):
        rounds += 1
        assert rounds < 5, "lazy stores keep evicting what they just stored"
        settle_all(t, stores)
    assert rounds == 1 and t.metrics.num_evicted_blocks == 0
    stored = [b for b in head if dev.pool.blocks[b].block_hash is not None][:3]
    view = t.coordinator.group_hashes(x.block_hashes)[0]
    hashes = {dev.pool.blocks[b].block_hash for b in stored}
    assert {h for h in view if t.host.contains((0, h))} == hashes  # the next ones to be evicted
    check(dev, t)


def test_59_reset_with_transfers_in_flight_abandons_them():
    dev = device()
    t = tier(dev)
    r = request(dev, "R", tokens(33))
    run(dev, r)
    [store] = t.plan_stores([r])
    assert t.reset_cache() is False
    settle_all(t, [store])
    assert host_has(t, r, [0, 1]) == [False, False]
    assert all(b.block_hash is None for b in t.host.pool.blocks)
    assert t.reset_cache() is True
    assert t.host.pool.num_cached_entries() == 0
    r2 = request(dev, "R2", tokens(33))
    run(dev, r2)
    [again] = t.plan_stores([r2])
    assert again.transfer_id > store.transfer_id
    check(dev, t)


def _chain_then_two_others(split: bool):
    """Host pool 7 (6 usable): R stores h0..h3 (in one transfer, or h0,h1 then h2,h3), then Q
    and P store two blocks each."""
    dev = device(24)
    t = tier(dev, 7, enable_kv_events=True)
    r = request(dev, "R", tokens(65))
    assert dev.allocate_slots(r, 65) is not None
    r.num_computed_tokens = 65
    r.ledger.append(StepRecord(1, 32, 0, 0))  # two prefill chunks
    r.ledger.append(StepRecord(2, 33, 0, 1))
    r.ledger.consume(1)
    if split:
        settle_all(t, t.plan_stores([r]))  # settled 32: h0, h1
    r.ledger.consume(2)
    settle_all(t, t.plan_stores([r]))
    q, p = request(dev, "Q", tokens(33)), request(dev, "P", tokens(33))
    run(dev, q)
    run(dev, p)
    settle_all(t, t.plan_stores([q]))
    settle_all(t, t.plan_stores([p]))
    return dev, t, r


def test_60a_chain_aware_eviction_keeps_the_chain_head_where_vllm_keeps_the_tail():
    """vLLM: h0, h1 evicted, h2, h3 kept but unreachable: a lookup returns 0 tokens. kvtier:
    the completed store freed h3..h0 deepest first, so h3, h2 went: the lookup returns 32.
    R lost h2, h3, but re-storing them would evict its own head: no re-store, no thrash."""
    dev, t, r = _chain_then_two_others(split=False)
    assert host_has(t, r, [0, 1, 2, 3]) == [True, True, False, False]
    assert t.store_progress("R").lost == {(0, 2), (0, 3)}
    assert t.host.peek_evictions(2) == [(0, r.block_hashes[1]), (0, r.block_hashes[0])]
    assert t.plan_stores([r]) == []
    assert t.metrics.num_restored_blocks == 0
    assert t.lookup(request(dev, "R2", r.all_token_ids), 0).num_tokens == 32
    t.cancel_load("R2")
    check(dev, t)


def test_60b_evicted_head_is_restored_with_the_absolute_cursor_without_thrash():
    """Stored in two transfers, R's head h0, h1 is the LRU and is evicted; h2, h3 become
    orphans and move to the LRU head. The next plan re-stores h0, h1 (evicting the orphans),
    the cursor stays at 4, and the re-store's own evictions trigger no further re-store."""
    dev, t, r = _chain_then_two_others(split=True)
    assert host_has(t, r, [0, 1, 2, 3]) == [False, False, True, True]
    assert t.host.pool.free_queue.block_ids()[:2] == [
        t.host.get((0, r.block_hashes[i])).block_id  # type: ignore[union-attr]
        for i in (3, 2)
    ]
    assert t.metrics.num_orphans_demoted >= 2
    restores = t.plan_stores([r])
    assert [len(x.src_block_ids) for x in restores] == [2]
    assert t.store_progress("R").cursor == (4,)
    settle_all(t, restores)
    assert host_has(t, r, [0, 1, 2, 3]) == [True, True, False, False]
    assert t.lookup(request(dev, "R2", r.all_token_ids), 0).num_tokens == 32
    t.cancel_load("R2")
    assert t.store_progress("R").lost == set()  # evicted by a re-store: not queued again
    assert t.plan_stores([r]) == []
    assert t.metrics.num_restored_blocks == 2
    check(dev, t)


def test_61_finish_flushes_settled_unstored_blocks_skipping_cached_ones():
    dev = device()
    t = tier(dev)
    toks = tokens(65)
    shared = request(dev, "S", toks[:49])
    run(dev, shared)
    settle_all(t, t.plan_stores([shared]))  # h0..h2 cached on the host
    r = request(dev, "R", toks)
    run(dev, r, settle=False)
    assert t.plan_stores([r]) == []  # nothing settled yet
    r.ledger.consume(1)
    [final] = t.finish_request(r)  # R is no longer scheduled
    assert final.src_block_ids == [dev.get_blocks("R")[0][3].block_id]
    dev.free("R")
    assert t.has_pending_stores
    settle_all(t, [final])
    assert not t.has_pending_stores and host_has(t, r, [0, 1, 2, 3]) == [True] * 4
    check(dev, t)
