"""Re-stores after host eviction across chains (issue 12 item 21): an eviction caused by one
request's re-store notifies the *other* requests whose chains held the evicted entries, so they
re-store too; each request re-stores a position at most once, so chains that cannot all fit stop
trading blocks instead of thrashing."""

from __future__ import annotations

from tests.offload.factories import check, device, host_has, request, run, settle_all, tier, tokens


def test_an_eviction_by_a_restore_notifies_the_other_chain() -> None:
    dev = device(24)
    t = tier(dev, 5)  # 4 usable host blocks: two chains of two blocks
    a, b, c = (request(dev, name, tokens(33)) for name in "ABC")
    for r in (a, b, c):
        run(dev, r)
        settle_all(t, t.plan_stores([r]))
    # C's store evicted A's chain (the LRU): A lost both blocks.
    assert t.store_progress("A").lost == {(0, 0), (0, 1)}
    assert host_has(t, b, [0, 1]) == [True, True]
    # A re-stores, evicting B's chain; B is told and re-stores in the same plan (before: B was
    # never told), evicting C's chain; C is told.
    restores = t.plan_stores([a, b, c])
    assert [x.req_id for x in restores] == ["A", "B"]
    assert t.store_progress("C").lost == {(0, 0), (0, 1)}
    settle_all(t, restores)
    restores = t.plan_stores([a, b, c])  # C re-stores, evicting A's re-stored chain
    assert [x.req_id for x in restores] == ["C"]
    settle_all(t, restores)
    assert t.store_progress("A").lost == set()  # A re-stored those positions once: done
    for _ in range(3):
        assert t.plan_stores([a, b, c]) == []  # no thrash
    assert [host_has(t, r, [0, 1]) for r in (a, b, c)] == [
        [False, False],
        [True, True],
        [True, True],
    ]
    assert t.metrics.num_restored_blocks == 6
    check(dev, t)
