"""Stores never read a block that a step still in flight may write — including the positions a
step launched with unverified drafts may write below its nominal start (it starts after the drafts
that get accepted, so the runner declares its writes from the lowest start a rollback allows)."""

from __future__ import annotations

from kvtier.bench.fake_runner import FakeRunner
from kvtier.sampling import StopConditions
from kvtier.sched import Request, Scheduler
from kvtier.sched.request import StepRecord
from tests.offload.factories import check, device, request, tier, tokens


def test_store_waits_for_a_step_launched_with_unverified_drafts():
    dev = device()
    t = tier(dev)
    r = request(dev, "R", tokens(64))
    assert dev.allocate_slots(r, 64) is not None
    # Step 5 (1 token + 4 drafts at 45..49) was processed, all drafts accepted; step 6 was launched
    # before that, so it may start anywhere from 46 (all rejected) and declares writes from there.
    r.num_computed_tokens = 55
    r.ledger.append(StepRecord(6, 5, 4, 5, lowest_write=46))
    [first] = t.plan_stores([r])  # settled is 50, but block 2 (32..47) may still be written
    assert first.src_block_ids == [b.block_id for b in dev.get_blocks("R")[0][:2]]
    r.ledger.consume(6)
    [second] = t.plan_stores([r])
    assert second.src_block_ids == [dev.get_blocks("R")[0][2].block_id]
    check(dev, t)


def test_the_scheduler_records_the_lowest_write_a_rollback_allows():
    """`StepRecord.lowest_write` is the start the runner declares: the scheduler's start minus the
    drafts of this request's steps still unprocessed when the step is launched."""
    s = Scheduler(device(64), async_depth=2, num_speculative_tokens=3)
    s.add_request(Request("A", [1, 2, 3] * 4, StopConditions(max_tokens=40, use_ngram=True)))
    runner = FakeRunner(acceptance_rate=0.5, num_speculative_tokens=3)
    pending = [s.schedule()]
    seen = []
    while s.has_unfinished_requests():
        request = s.requests.get("A")
        if request is not None and request.status.name == "RUNNING":
            before = request.num_computed_tokens
            unverified = sum(x.num_draft_tokens for x in request.ledger.records)
            out = s.schedule()
            pending.append(out)
            if "A" in out.num_scheduled_tokens:
                rec = request.ledger.records[-1]
                assert rec.lowest_write == (max(0, before - unverified) if unverified else None)
                seen.append(rec.lowest_write)
        out = pending.pop(0)
        s.update(out, runner.execute(out))
    assert any(x is not None for x in seen), "no step was launched with drafts unverified"
