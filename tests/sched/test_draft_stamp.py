"""The quarantine stamp of window pruning (issue 12 items 19, 22b): pruned blocks are held until
the latest unprocessed step that declared a start below the prune basis is processed — a step
launched while earlier drafts were unverified, whether or not it has drafts of its own."""

from __future__ import annotations

from kvtier.kv import KVCacheManager, SlidingWindow
from kvtier.sampling import StopConditions
from kvtier.sched import Request, SettledLifetimes, StepRecord


def _request(records: list[StepRecord], num_computed: int) -> Request:
    r = Request("r", list(range(1, 11)), StopConditions(max_tokens=30))
    for record in records:
        r.ledger.append(record)
    r.num_computed_tokens = num_computed
    return r


def _lifetimes() -> SettledLifetimes:
    return SettledLifetimes(KVCacheManager([SlidingWindow(3, 8)], 20, max_model_len=64))


def test_a_step_declared_below_the_basis_stamps_the_prune_without_drafts_of_its_own() -> None:
    # Step 7 (1 token, no drafts) was launched while step 6's 2 drafts were unverified: it
    # declared its window from 16; step 6 is processed with both drafts accepted, so the
    # settled count is 19 and step 7 may still gather blocks pruned at 19.
    r = _request([StepRecord(7, 1, 0, 1, lowest_write=16)], num_computed=20)
    assert r.ledger.num_draft_tokens == 0 and r.num_settled_tokens == 19
    assert _lifetimes().basis(r, processed_step_seq=6) == (19, 7)


def test_the_latest_such_step_stamps_and_steps_declared_at_or_above_the_basis_do_not() -> None:
    records = [
        StepRecord(7, 3, 2, 3, lowest_write=16),
        StepRecord(8, 1, 0, 1, lowest_write=17),
        StepRecord(9, 1, 0, 1, lowest_write=None),
    ]
    r = _request(records, num_computed=24)  # settled 24 − 5 = 19
    assert _lifetimes().basis(r, processed_step_seq=6) == (19, 8)
    r = _request([StepRecord(7, 1, 0, 1, lowest_write=19)], num_computed=20)
    assert _lifetimes().basis(r, processed_step_seq=6) == (19, 6)  # freed at once
    r = _request([StepRecord(7, 3, 2, 3)], num_computed=22)  # drafts, but no lower start
    assert _lifetimes().basis(r, processed_step_seq=6) == (19, 6)
