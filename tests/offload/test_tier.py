"""HostTier beyond group F: concurrent loads, load failure rollback (H7), one restore boundary
for hybrid models (H6), out-of-order completion, pinned-full accounting, re-store rate limit,
metrics, and that the planning half imports no torch."""

from __future__ import annotations

from kvtier.kv import BlockStored, FullAttention, Mamba, SlidingWindow
from kvtier.offload import HostTier
from kvtier.sched.request import RequestStatus
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
from tests.torch_blocked import run_without_torch


def _stored(dev, t, toks, rid="R"):
    r = request(dev, rid, toks)
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    t.finish_request(r)
    dev.free(rid)
    dev.pool.evict_blocks(range(1, dev.pool.num_blocks))  # the device forgets it
    return r


def test_a_prefix_being_loaded_is_waited_on_not_loaded_twice():
    dev = device(24)
    t = tier(dev)
    toks = tokens(49)
    _stored(dev, t, toks)
    a = request(dev, "A", toks)
    load = admit_with_load(dev, t, a)
    assert load is not None and load.num_blocks == 3
    b = request(dev, "B", toks)
    answer = t.lookup(b, 0)
    assert answer.num_tokens == 0 and answer.wait_for_load
    assert t.metrics.num_load_waits == 1
    assert t.complete([load.transfer_id]) == ["A"]
    dev.cache_blocks(a, 48)  # the scheduler publishes A's blocks once loaded
    _, num_hit = dev.get_computed_blocks(b)
    assert num_hit == 48 and t.lookup(b, num_hit).num_tokens == 0
    check(dev, t)


def test_failed_load_rolls_back_to_the_device_hit_and_reports_bad_blocks():
    dev = device(24)
    t = tier(dev)
    toks = tokens(49)
    _stored(dev, t, toks)
    q = request(dev, "Q", toks)
    load = admit_with_load(dev, t, q)
    assert load is not None and q.num_computed_tokens == 48
    failure = t.fail(load.transfer_id)
    assert failure is not None and failure.num_good_tokens == 0 and not failure.must_reallocate
    assert failure.evict_device_block_ids == load.dst_block_ids
    # a decision only: the scheduler rolls the request back (the tier never writes it)
    assert q.num_computed_tokens == 48 and q.status is RequestStatus.WAITING
    assert not t.device_pins() and t.metrics.num_failed_loads == 1
    check(dev, t)


def test_partially_failed_load_keeps_the_good_prefix():
    dev = device(24)
    t = tier(dev)
    toks = tokens(49)
    _stored(dev, t, toks)
    q = request(dev, "Q", toks)
    load = admit_with_load(dev, t, q)
    assert load is not None
    failure = t.fail(load.transfer_id, [load.dst_block_ids[2]])
    assert failure is not None and failure.num_good_tokens == 32
    assert failure.evict_device_block_ids == [load.dst_block_ids[2]]
    assert q.num_computed_tokens == 48  # unchanged: the scheduler applies the rollback
    check(dev, t)


def test_failed_load_with_a_window_group_asks_for_reallocation():
    dev = device(32, [FullAttention(16), SlidingWindow(16, 32)])
    t = tier(dev)
    toks = tokens(65)
    _stored(dev, t, toks)
    q = request(dev, "Q", toks)
    load = admit_with_load(dev, t, q)
    assert load is not None and q.num_computed_tokens == 48
    failure = t.fail(load.transfer_id)
    assert failure is not None and failure.must_reallocate and failure.num_good_tokens == 0
    assert q.num_computed_tokens == 48  # unchanged: the scheduler frees and re-admits it
    check(dev, t)


def test_hybrid_groups_restore_to_one_aligned_boundary_or_nothing():
    """H6: a host hit counts only up to where every group restores (here group 1's third block
    was evicted from the host: both groups stop at 64 tokens, not group 0's 96)."""
    dev = device(32, [FullAttention(16), FullAttention(32)])
    t = tier(dev, 16)
    toks = tokens(97)
    r = _stored(dev, t, toks)
    view1 = t.coordinator.group_hashes(r.block_hashes)[1]
    assert t.host.evict((1, view1[2]))
    q = request(dev, "Q", toks)
    assert t.lookup(q, 0).num_tokens == 64
    load = t.plan_load(q, 0)
    assert load is None
    check(dev, t)


def test_completions_out_of_order_each_release_their_own_pins():
    dev = device(24)
    t = tier(dev)
    a, b = request(dev, "A", tokens(33)), request(dev, "B", tokens(33))
    run(dev, a)
    run(dev, b)
    sa, sb = t.plan_stores([a, b])
    t.complete([sb.transfer_id])
    assert host_has(t, b, [0, 1]) == [True, True] and host_has(t, a, [0, 1]) == [False, False]
    assert sorted(t.device_pins()) == sorted(sa.src_block_ids)
    check(dev, t)
    t.complete([sa.transfer_id, sa.transfer_id])  # a repeated report is ignored once ended
    assert not t.device_pins()
    check(dev, t)


def test_blocks_not_planned_for_a_pinned_full_host_pool_are_counted_and_retried():
    dev = device(24)
    t = tier(dev, 3)  # 2 usable host blocks
    a, b = request(dev, "A", tokens(33)), request(dev, "B", tokens(33))
    run(dev, a)
    run(dev, b)
    [sa] = t.plan_stores([a, b])  # A takes both host blocks; B's two are skipped
    assert sa.req_id == "A" and t.metrics.num_skipped_pinned_full == 2
    assert t.store_progress("B").cursor == (0,)  # not advanced past what was not stored
    settle_all(t, [sa])
    t.finish_request(a)
    [sb] = t.plan_stores([b])
    assert sb.req_id == "B" and sb.num_blocks == 2
    check(dev, t)


def test_restores_are_capped_per_step():
    dev = device(64)
    t = tier(dev, 9, max_restores_per_step=1)  # 8 usable
    owners = [request(dev, f"R{i}", tokens(33)) for i in range(4)]
    for r in owners:
        run(dev, r)
        settle_all(t, t.plan_stores([r]))
    others = [request(dev, f"O{i}", tokens(33)) for i in range(2)]
    for o in others:
        run(dev, o)
    settle_all(t, t.plan_stores(others))  # evicts R0 and R1
    for o in others:
        t.finish_request(o)
    lost = [len(t.store_progress(r.request_id).lost) for r in owners]
    assert lost == [2, 2, 0, 0]
    restores = t.plan_stores(owners)
    assert sum(x.num_blocks for x in restores) == 1
    assert t.metrics.num_restored_blocks == 1
    check(dev, t)


def test_bytes_are_counted_per_group_and_pending_gauges_follow_transfers():
    dev = device(24, [FullAttention(16), SlidingWindow(16, 64)])
    t = HostTier(dev, 16, bytes_per_block=[100, 10])
    r = request(dev, "R", tokens(33))
    run(dev, r)
    [s] = t.plan_stores([r])
    assert s.num_bytes == 2 * 100 + 2 * 10 and t.metrics.num_pending_stores == 1
    settle_all(t, [s])
    assert t.metrics.num_stored_bytes == 220 and t.metrics.num_pending_stores == 0
    assert s.planned().transfer_id == s.transfer_id and not s.planned().is_load


def test_state_snapshots_are_stored_and_loaded_with_the_attention_blocks():
    """architecture.md §Tiering: a state group publishes only snapshots (pages a verified step
    ended on), so only those reach the host; a load restores one boundary for every group: the
    attention blocks up to it and the one state page at it."""
    specs = [FullAttention(16), Mamba(16)]
    dev = device(24, specs)
    t = tier(dev)
    toks = tokens(33)
    r = request(dev, "R", toks)
    for n in (16, 16):  # two chunks, each ending on a boundary: snapshots at 16 and 32
        assert dev.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        dev.cache_verified(r, r.num_computed_tokens)
    stores = t.plan_stores([r])
    assert sorted(g for s in stores for g in s.group_ids) == [0, 0, 1, 1]
    settle_all(t, stores)
    t.finish_request(r)
    dev.free("R")
    dev.pool.evict_blocks(range(1, dev.pool.num_blocks))  # the device forgets it
    q = request(dev, "Q", toks)
    hits, num_hit = dev.get_computed_blocks(q)
    ext = t.lookup(q, num_hit).num_tokens
    assert (num_hit, ext) == (0, 32)
    # as Admission._try_load: the load's destinations alone, no new token yet (a state group's
    # one real page is then the page at the boundary, which the first step reads)
    got = dev.allocate_slots(
        q,
        0,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_external_computed_tokens=ext,
        delay_cache_blocks=True,
    )
    assert got is not None
    q.num_computed_tokens = ext
    load = t.plan_load(q, ext)
    assert load is not None
    assert sorted(load.group_ids) == [0, 0, 1]  # the state page at 32 only
    check(dev, t)


def test_planning_modules_import_no_torch():
    out = run_without_torch(
        """
import importlib, pkgutil
import kvtier.offload
names = [m.name for m in pkgutil.iter_modules(kvtier.offload.__path__)]
for name in names:
    importlib.import_module(f"kvtier.offload.{name}")
print("ok", len(names))
"""
    )
    assert out.startswith("ok ")
    assert int(out.split()[1]) >= 6  # every planning module, not just the package


def test_host_events_name_each_stored_block_its_parent_and_its_tokens():
    dev = device(enable_kv_events=True)
    t = tier(dev, enable_kv_events=True)
    toks = tokens(49)
    r = request(dev, "R", toks)
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    stored = [e for e in t.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[h] for h in r.block_hashes[:3]]
    assert [e.parent_block_hash for e in stored] == [None, *r.block_hashes[:2]]
    assert [e.token_ids for e in stored] == [toks[i * 16 : (i + 1) * 16] for i in range(3)]
    assert all(e.medium == "host" and e.block_size == 16 for e in stored)


def test_host_blocks_are_not_announced_without_their_tokens():
    """A consumer matches blocks by their tokens: a store whose device copy was cached without
    events (no tokens kept) is not announced rather than announced empty."""
    dev = device()
    t = tier(dev, enable_kv_events=True)
    r = request(dev, "R", tokens(49))
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    assert [e for e in t.take_events() if isinstance(e, BlockStored)] == []


def _device_keeps_head_host_keeps_rest(specs):
    dev = device(40, specs)
    t = tier(dev, 24)
    toks = tokens(97)
    r = request(dev, "R", toks)
    run(dev, r)
    settle_all(t, t.plan_stores([r]))
    t.finish_request(r)
    tables = dev.get_blocks("R")
    dev.free("R")
    dev.pool.evict_blocks([b.block_id for table in tables for b in table[2:]])
    for g, view in enumerate(t.coordinator.group_hashes(r.block_hashes)):
        for h in view[:2]:
            t.host.evict((g, h))  # the host lost the head the device still serves
    q = request(dev, "Q", toks)
    hits, num_hit = dev.get_computed_blocks(q)
    return dev, t, q, hits, num_hit


def test_a_host_hit_extends_the_device_hit_without_the_host_holding_the_head():
    """A lookup from token 0 (vLLM's) finds nothing on the host here: h0, h1 were evicted
    there while the device keeps serving them. kvtier looks up from the device hit on."""
    dev, t, q, hits, num_hit = _device_keeps_head_host_keeps_rest([FullAttention(16)])
    assert num_hit == 32
    assert t.lookup(q, num_hit).num_tokens == 64
    assert (
        dev.allocate_slots(
            q,
            1,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_external_computed_tokens=64,
            delay_cache_blocks=True,
        )
        is not None
    )
    load = t.plan_load(q, 64)
    assert load is not None and load.num_blocks == 4
    check(dev, t)


def test_a_window_group_reads_across_the_device_and_host_parts_of_a_hit():
    dev, t, q, hits, num_hit = _device_keeps_head_host_keeps_rest(
        [FullAttention(16), SlidingWindow(16, 32)]
    )
    assert num_hit == 32
    assert t.lookup(q, num_hit).num_tokens == 64
    assert (
        dev.allocate_slots(
            q,
            1,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_external_computed_tokens=64,
            delay_cache_blocks=True,
        )
        is not None
    )
    load = t.plan_load(q, 64)
    assert load is not None and 0 not in load.dst_block_ids
    # full attention: positions 2..5; the window (2 blocks before 96): positions 4, 5
    assert sorted(load.group_ids) == [0, 0, 0, 0, 1, 1]
    check(dev, t)


def test_store_from_settled_off_plans_blocks_of_steps_still_executing():
    """Protection `settled` off (vLLM's confirmed count): a prefill chunk still in flight is
    planned for store at once, which only the compute-done event can order (H1)."""
    dev = device()
    r = request(dev, "R", tokens(33))
    run(dev, r, settle=False)  # one prefill step, scheduled, not processed
    assert tier(dev).plan_stores([r]) == []
    [store] = tier(dev, store_from_settled=False).plan_stores([r])
    assert store.num_blocks == 2
