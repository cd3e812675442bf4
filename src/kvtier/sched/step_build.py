"""The step being built: what `Scheduler.schedule()` has given running requests so far (taken back
from one chosen as a preemption victim before the step is emitted) and the requests `Admission`
admitted into it. Touches only its own lists and, on a take-back, the victim's newest ledger
record and counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.ids import ReqId
from kvtier.sched.output import BlockIds, CachedRequestData, NewRequestData
from kvtier.sched.request import Request, StepRecord


@dataclass(slots=True)
class StepBuild:
    """Requests scheduled so far in step `step_seq`, with the token budget left."""

    step_seq: int
    budget: int  # tokens left in the step
    num_scheduled: dict[ReqId, int] = field(default_factory=dict)
    spec_tokens: dict[ReqId, list[int]] = field(default_factory=dict)
    cached: list[CachedRequestData] = field(default_factory=list)
    new: list[NewRequestData] = field(default_factory=list)
    preempted: list[ReqId] = field(default_factory=list)

    def add(
        self, request: Request, n: int, drafts: list[int], blocks: BlockIds, record: StepRecord
    ) -> None:
        """Record `n` tokens (drafts included) of `request`, whose ledger holds `record`."""
        rid = request.request_id
        self.num_scheduled[rid] = n
        if drafts:
            self.spec_tokens[rid] = drafts
        start = request.num_computed_tokens - n
        lowest = start if record.lowest_write is None else record.lowest_write
        self.cached.append(CachedRequestData(rid, blocks, start, lowest))
        self.budget -= n

    def add_new(self, data: NewRequestData, n: int) -> None:
        """Record an admitted request computing `n` tokens, sent whole as `data`."""
        self.num_scheduled[data.req_id] = n
        self.new.append(data)
        self.budget -= n

    def take_back(self, request: Request, processed_step_seq: int) -> None:
        """Undo `add` for a victim about to be preempted: its tokens return to the budget, its
        ledger record of this step goes, its last scheduled step is the one before."""
        rid = request.request_id
        n = self.num_scheduled.pop(rid)
        self.spec_tokens.pop(rid, None)
        self.cached[:] = [c for c in self.cached if c.req_id != rid]
        self.budget += n
        request.ledger.retract(self.step_seq)
        request.num_computed_tokens -= n
        records = request.ledger.records
        request.last_sched_seq = records[-1].step_seq if records else processed_step_seq
