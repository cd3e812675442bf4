"""A deterministic fake runner and a batch-queue driver, for tests and host-overhead benchmarks.

Sampled tokens are a pure function of (request, position), so outputs must not depend on async
depth, chunking or caching. Drafts are accepted by matching that truth or at a seeded rate.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.sched.batch_queue import BatchQueue
from kvtier.sched.ngram import NgramProposer
from kvtier.sched.oracle import AccessOracle
from kvtier.sched.output import RequestUpdate, RunnerOutput, SchedulerOutput
from kvtier.sched.scheduler import Scheduler

TokenFn = Callable[[str, int], int]


def hashed_token(vocab_size: int) -> TokenFn:
    """Token at `position` of `req_id`: a CRC of both, in [0, vocab_size)."""

    def token(req_id: str, position: int) -> int:
        return zlib.crc32(f"{req_id}:{position}".encode()) % vocab_size

    return token


@dataclass(slots=True)
class _RunnerRequest:
    token_ids: list[int]  # known tokens (prompt + outputs sampled so far)
    position: int  # device-side computed tokens: next query position
    tables: list[list[int]]  # block ids per group, built from the step diffs


class FakeRunner:
    """Executes a `SchedulerOutput` at once and returns its `RunnerOutput` (planned copies
    between tiers are reported done in the same step; they carry no data here).

    `acceptance_rate=None` accepts a draft iff it equals the true token (placeholder drafts are
    proposed here by the same n-gram proposer); a float accepts each draft with that seeded chance.
    """

    def __init__(
        self,
        *,
        token_fn: TokenFn | None = None,
        acceptance_rate: float | None = None,
        seed: int = 0,
        oracle: AccessOracle | None = None,
        num_speculative_tokens: int = 1,
    ) -> None:
        if acceptance_rate is not None and not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1] or None, got {acceptance_rate}")
        self.token_fn = token_fn or hashed_token(32000)
        self.acceptance_rate = acceptance_rate
        self.seed = seed
        self.oracle = oracle
        self.proposer = NgramProposer(max(1, num_speculative_tokens))
        self.state: dict[str, _RunnerRequest] = {}
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def _accepts(self, req_id: str, position: int, draft: int) -> bool:
        if self.acceptance_rate is None:
            return draft == self.token_fn(req_id, position)
        h = zlib.crc32(f"{self.seed}:{req_id}:{position}".encode()) / 0xFFFFFFFF
        return h < self.acceptance_rate

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Apply the step's diffs, run every scheduled request, return sampled tokens (mutates)."""
        if self.oracle is not None:
            self.oracle.on_schedule(output)
        state = self.state
        for req_id in output.preempted_req_ids:
            del state[req_id]
        for req_id in output.finished_req_ids:
            state.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            tables = [list(ids) for ids in new.block_ids]
            state[new.req_id] = _RunnerRequest(list(new.token_ids), new.num_computed_tokens, tables)
        lowest: dict[str, int] = {}  # declared starts of steps launched with drafts unverified
        for cached in output.scheduled_cached_reqs:
            st = state[cached.req_id]
            for table, ids in zip(st.tables, cached.new_block_ids, strict=True):
                table.extend(ids)
            assert st.position <= cached.num_computed_tokens, "device ahead of the host"
            lowest[cached.req_id] = cached.lowest_start
        sampled: dict[str, list[int]] = {}
        spec = output.scheduled_spec_decode_tokens
        for req_id, n in output.num_scheduled_tokens.items():
            st = state[req_id]
            drafts = spec.get(req_id, [])
            start, num_real = st.position, n - len(drafts)
            if self.oracle is not None:
                self.oracle.on_execute(
                    output.step_seq, req_id, st.tables, start, start + n, lowest.get(req_id)
                )
            end_real = start + num_real
            if end_real < len(st.token_ids):  # a prefill chunk: no sample
                assert not drafts, "drafts on a prefill chunk"
                st.position = end_real
                continue
            sampled[req_id] = self._sample(req_id, st, drafts)
            st.position = end_real + len(sampled[req_id]) - 1
        copies = [t.transfer_id for t in output.planned_transfers]  # they land within the step
        return RunnerOutput(output.step_seq, sampled, finished_transfers=copies)

    def _sample(self, req_id: str, st: _RunnerRequest, drafts: list[int]) -> list[int]:
        if drafts and drafts[0] == -1:  # placeholders: propose here, on the device's tokens
            proposed = self.proposer.propose(st.token_ids, len(drafts))
            drafts = proposed + [-1] * (len(drafts) - len(proposed))
        base = len(st.token_ids)
        accepted = 0
        for j, draft in enumerate(drafts):
            if not self._accepts(req_id, base + j, draft):
                break
            accepted += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        tokens = [self.token_fn(req_id, base + j) for j in range(accepted + 1)]
        st.token_ids.extend(tokens)
        return tokens

    def on_processed(self, step_seq: int) -> None:
        """The host processed `step_seq` (tells the oracle)."""
        if self.oracle is not None:
            self.oracle.on_processed(step_seq)


class FakeEngine:
    """The engine loop over a fake runner: a `BatchQueue` of up to `async_depth` steps."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.queue: BatchQueue[RunnerOutput] = BatchQueue(scheduler, runner.execute)

    @property
    def num_steps(self) -> int:
        return self.queue.num_steps

    @property
    def in_flight(self) -> deque[tuple[SchedulerOutput, RunnerOutput]]:
        return self.queue.in_flight

    def step(self) -> list[RequestUpdate]:
        """Schedule one step if allowed, else process the oldest; returns processed outputs."""
        return self._process(self.queue.advance())

    def process_oldest(self) -> list[RequestUpdate]:
        """Feed the oldest in-flight step's result back to the scheduler ([] if none)."""
        return self._process(self.queue.pop_oldest())

    def _process(self, item: tuple[SchedulerOutput, RunnerOutput] | None) -> list[RequestUpdate]:
        if item is None:
            return []
        output, result = item
        outputs = self.scheduler.update(output, result)
        self.runner.on_processed(output.step_seq)
        return outputs

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until every request finished and no step is in flight; returns steps taken.

        RuntimeError if `max_steps` pass first (a request that can never be scheduled).
        """
        for i in range(max_steps):
            if not self.queue and not self.scheduler.has_unfinished_requests():
                return i
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} engine steps")
