"""One-line factories and a manual step driver for the scheduler tests (no fixtures)."""

from __future__ import annotations

import itertools
from typing import Any

from kvtier.kv import FullAttention, KVCacheManager, KVSpec
from kvtier.sampling import StopConditions
from kvtier.sched import Request, RunnerOutput, Scheduler, SchedulerOutput
from tests.sched.invariants import check_scheduler

_fresh = itertools.count(1_000_000)


def fresh_tokens(n: int) -> list[int]:
    """`n` token ids that match nothing else built by this module."""
    return [next(_fresh) for _ in range(n)]


def scheduler(
    num_blocks: int = 100,
    specs: list[KVSpec] | None = None,
    *,
    max_model_len: int = 4096,
    budget: int = 1024,
    depth: int = 2,
    caching: bool = True,
    quarantine: bool = True,
    max_in_flight_tokens: int | None = None,
    **kw: Any,
) -> Scheduler:
    """A scheduler over its own KVCacheManager; `max_in_flight_tokens` defaults to depth × budget."""
    kv = KVCacheManager(
        specs or [FullAttention(16)],
        num_blocks,
        max_model_len=max_model_len,
        enable_caching=caching,
        enable_quarantine=quarantine,
        max_in_flight_tokens=depth * budget
        if max_in_flight_tokens is None
        else max_in_flight_tokens,
    )
    return Scheduler(kv, max_num_batched_tokens=budget, async_depth=depth, **kw)


def request(req_id: str, prompt: int | list[int], max_tokens: int = 16, **sampling: Any) -> Request:
    tokens = fresh_tokens(prompt) if isinstance(prompt, int) else prompt
    return Request(req_id, tokens, StopConditions(max_tokens=max_tokens, **sampling))


class Driver:
    """Manual schedule()/process() with fabricated outputs; checks invariants after every call."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.outputs: dict[int, SchedulerOutput] = {}
        self.next_token = 7

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.outputs[out.step_seq] = out
        check_scheduler(self.sched)
        return out

    def process(self, step: int, tokens: dict[str, list[int]] | None = None) -> None:
        """Feed step `step` back: `tokens` per request, else one token per sampling request."""
        out = self.outputs.pop(step)
        sampled = dict(tokens or {})
        for req_id in out.num_scheduled_tokens:
            if req_id not in sampled and self._samples(out, req_id):
                sampled[req_id] = [self.next_token]
        self.sched.update(out, RunnerOutput(step, sampled))
        check_scheduler(self.sched)

    def _samples(self, out: SchedulerOutput, req_id: str) -> bool:
        request = self.sched.requests.get(req_id)
        if request is None:
            return True
        record = next((r for r in request.ledger.records if r.step_seq == out.step_seq), None)
        return record is None or record.num_placeholders > 0

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        """Alternate schedule/process at the scheduler's depth until nothing is left."""
        sched = self.sched
        for _ in range(max_steps):
            if not sched.has_unfinished_requests() and not self.outputs:
                return
            if sched.can_schedule() and sched.has_unfinished_requests():
                self.schedule()
                if sched.can_schedule():
                    continue
            self.process(min(self.outputs))
        raise AssertionError("did not finish")


def null_count(sched: Scheduler, req_id: str, group: int = 0) -> int:
    return sum(1 for b in sched.kv.get_blocks(req_id)[group] if b.is_null)
