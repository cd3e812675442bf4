"""A deterministic fake runner: `kvtier bench sched` drives the real scheduler with it (and the
scheduler tests do too), so it ships with the benchmarks rather than in `sched/`.

Sampled tokens are a pure function of (request, position), so outputs must not depend on async
depth, chunking or caching. Drafts are accepted by matching that truth or at a seeded rate. An
optional `StepObserver` (the tests' access oracle) sees every step scheduled, executed and
processed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtier.sched.ngram import NgramProposer
from kvtier.sched.output import RunnerOutput, SchedulerOutput

TokenFn = Callable[[str, int], int]


class StepObserver(Protocol):
    """What watches a fake run: each step as scheduled, each request's share as executed (its
    tables as the runner built them, its query positions [start, end), the lower start it
    declared when drafts were unverified), and each step once the host processed it."""

    def on_schedule(self, output: SchedulerOutput) -> None: ...

    def on_execute(
        self,
        step_seq: int,
        req_id: str,
        runner_tables: list[list[int]],
        start: int,
        end: int,
        declared_start: int | None = None,
    ) -> None: ...

    def on_processed(self, step_seq: int) -> None: ...


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
        oracle: StepObserver | None = None,
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
