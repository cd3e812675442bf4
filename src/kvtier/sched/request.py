"""A scheduled request: stop conditions, status, output tokens and the per-step ledger.

The ledger is the only place in-flight tokens, output placeholders and stale shares come from;
nothing here picks requests or touches blocks.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.ids import ReqId
from kvtier.kv.block_pool import IntegrityError
from kvtier.kv.hashing import BlockHasher, HashExtras
from kvtier.kv.request import KVSequence
from kvtier.sampling import DrawParams, StopConditions


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # an external KV load is pending
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(slots=True)
class StepRecord:
    """One scheduled step of one request; appended at schedule time, consumed exactly once."""

    step_seq: int  # sched_step_seq of the step
    num_scheduled_tokens: int  # tokens the step computes for this request, drafts included
    num_draft_tokens: int  # of which speculative drafts
    num_placeholders: int  # output positions it adds: 1 + drafts if the step samples, else 0
    stale: bool = False  # the request was preempted after this step was scheduled
    # Lowest position the step may write, as the runner declares it at launch: below its start
    # by the drafts still unverified then (it starts after those that are accepted). None: its
    # start (no drafts were unverified).
    lowest_write: int | None = None


class StepLedger:
    """FIFO of a request's unprocessed steps with running sums derived from the records.

    INVARIANT: each sum equals the sum over `records` of its field (stale ones excluded where
    named `live`); only `append`, `retract`, `consume` and `mark_stale` change records or sums.
    """

    __slots__ = (
        "num_draft_tokens",
        "num_in_flight_tokens",
        "num_live_in_flight_tokens",
        "num_pending_samples",
        "num_placeholders",
        "num_processed_tokens",
        "num_scheduled_tokens",
        "records",
    )

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque()
        self.num_in_flight_tokens = 0  # all records
        self.num_draft_tokens = 0  # all records: drafts not verified yet
        self.num_live_in_flight_tokens = 0  # records of the current incarnation
        self.num_placeholders = 0  # live output positions not yet delivered
        self.num_pending_samples = 0  # live records that will deliver ≥ 1 token
        self.num_scheduled_tokens = 0  # Σ ever appended
        self.num_processed_tokens = 0  # Σ ever consumed

    def append(self, record: StepRecord) -> None:
        """Add a scheduled step (mutates)."""
        self.records.append(record)
        n = record.num_scheduled_tokens
        self.num_in_flight_tokens += n
        self.num_draft_tokens += record.num_draft_tokens
        self.num_live_in_flight_tokens += n
        self.num_placeholders += record.num_placeholders
        self.num_pending_samples += record.num_placeholders > 0
        self.num_scheduled_tokens += n

    def consume(self, step_seq: int) -> StepRecord | None:
        """Pop the record of `step_seq` (mutates); None if the request was not in that step.
        Steps are consumed in order: an older record left behind would hold its tokens in flight
        for good, so it raises `IntegrityError`, `python -O` or not."""
        records = self.records
        if not records or records[0].step_seq != step_seq:
            if records and records[0].step_seq < step_seq:
                raise IntegrityError(
                    f"ledger skipped a step: consumed {step_seq} before {records[0].step_seq}"
                )
            return None
        record = records.popleft()
        n = record.num_scheduled_tokens
        self.num_in_flight_tokens -= n
        self.num_draft_tokens -= record.num_draft_tokens
        self.num_processed_tokens += n
        if not record.stale:
            self.num_live_in_flight_tokens -= n
            self.num_placeholders -= record.num_placeholders
            self.num_pending_samples -= record.num_placeholders > 0
        return record

    def retract(self, step_seq: int) -> None:
        """Drop the record of `step_seq`, the newest, appended by a step not yet emitted (a
        preemption victim taken back from the step being built; mutates)."""
        record = self.records.pop()
        assert record.step_seq == step_seq and not record.stale, "retract the newest live record"
        n = record.num_scheduled_tokens
        self.num_in_flight_tokens -= n
        self.num_draft_tokens -= record.num_draft_tokens
        self.num_live_in_flight_tokens -= n
        self.num_placeholders -= record.num_placeholders
        self.num_pending_samples -= record.num_placeholders > 0
        self.num_scheduled_tokens -= n

    def mark_stale(self) -> None:
        """Preemption: outstanding records no longer belong to the request's new incarnation."""
        for record in self.records:
            record.stale = True
        self.num_live_in_flight_tokens = 0
        self.num_placeholders = 0
        self.num_pending_samples = 0

    @property
    def num_stale_tokens(self) -> int:
        return self.num_in_flight_tokens - self.num_live_in_flight_tokens

    def __len__(self) -> int:
        return len(self.records)


class Request(KVSequence):
    """Prompt, outputs, status and ledger of one generation request.

    `num_computed_tokens` is optimistic (advanced at schedule time, rolled back for rejected
    drafts); `num_settled_tokens` is what the host knows the device has finished for the current
    incarnation. Lower `priority` values run first under the priority policy.
    """

    def __init__(
        self,
        request_id: ReqId,
        prompt_token_ids: Sequence[int],
        stop: StopConditions | None = None,
        *,
        draw: DrawParams | None = None,
        priority: int = 0,
        arrival_seq: int = 0,
        hasher: BlockHasher | None = None,
        extras: HashExtras | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, hasher, extras)
        self.stop = sp = stop or StopConditions()
        self.draw = draw or DrawParams()  # carried to the runner; the scheduler never reads it
        stops = set(sp.stop_token_ids)
        if sp.eos_token_id is not None and not sp.ignore_eos:
            stops.add(sp.eos_token_id)
        self._stop_ids = frozenset(stops)
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.status = RequestStatus.WAITING
        self.ledger = StepLedger()
        self.last_sched_seq = 0  # the last step that scheduled tokens of this request
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_external_cached_tokens = 0  # of which loaded from a tier below the device
        self.admit_seq = 0  # the step that (re)admitted it; hit blocks may be written up to it
        self.lookup_counted = False  # its prefix lookup is in the stats (reset on preemption)
        # Scheduler memo of its last KV calls for this table (reset when the table is dropped):
        self.prune_at = 0  # the next token count at which pruning can free a block
        self.num_slot_tokens = 0  # positions every group's table already covers
        self.cached_basis = 0  # token count blocks were last published up to

    # ---- derived counts ------------------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_in_flight_tokens(self) -> int:
        """Scheduled but unprocessed tokens, stale records included."""
        return self.ledger.num_in_flight_tokens

    @property
    def num_output_placeholders(self) -> int:
        return self.ledger.num_placeholders

    @property
    def num_settled_tokens(self) -> int:
        """num_computed_tokens − live in-flight tokens (never negative; ≤ committed length)."""
        return self.num_computed_tokens - self.ledger.num_live_in_flight_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def reaches_max_tokens(self, max_model_len: int) -> bool:
        """True if the steps in flight already end the request by length (no new step needed)."""
        num_pending = self.ledger.num_pending_samples
        num_tokens = len(self.all_token_ids) + num_pending
        return (
            num_tokens - self.num_prompt_tokens >= self.stop.max_tokens
            or num_tokens >= max_model_len
        )

    def max_new_drafts(self, k: int, max_model_len: int) -> int:
        """Drafts that still fit before max_tokens / max_model_len, at most `k`."""
        num_pending = self.ledger.num_pending_samples
        room_out = self.stop.max_tokens - self.num_output_tokens - num_pending - 1
        room_len = max_model_len - self.num_tokens - self.ledger.num_placeholders - 1
        return max(0, min(k, room_out, room_len))

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule_step(self, step_seq: int, n: int, num_drafts: int, samples: bool) -> StepRecord:
        """Append the ledger record of step `step_seq` computing `n` tokens (`num_drafts` of them
        drafts; `samples`: it delivers tokens) and advance the optimistic count (mutates)."""
        unverified = self.ledger.num_draft_tokens
        lowest = max(0, self.num_computed_tokens - unverified) if unverified else None
        num_placeholders = 1 + num_drafts if samples else 0
        record = StepRecord(step_seq, n, num_drafts, num_placeholders, lowest_write=lowest)
        self.ledger.append(record)
        self.num_computed_tokens += n
        self.last_sched_seq = step_seq
        return record

    # ---- token delivery ------------------------------------------------------------------------

    def deliver(
        self, token_ids: Sequence[int], max_model_len: int
    ) -> tuple[RequestStatus | None, list[int]]:
        """Append sampled tokens up to the first stop condition (mutates).

        Returns (the finished status if one was reached, else None; the tokens appended). Tokens
        after a stop are dropped. EOS and stop tokens count only from `min_tokens` outputs on.
        """
        sp = self.stop
        num_out = len(self.all_token_ids) - self.num_prompt_tokens
        room = min(sp.max_tokens - num_out, max_model_len - len(self.all_token_ids))
        assert room > 0, f"{self.request_id} delivered past its length limit"
        reason: RequestStatus | None = None
        tokens = list(token_ids)
        if len(tokens) >= room:
            del tokens[room:]
            reason = RequestStatus.FINISHED_LENGTH
        stops = self._stop_ids
        if stops:
            for i in range(max(0, sp.min_tokens - num_out - 1), len(tokens)):
                if tokens[i] in stops:
                    del tokens[i + 1 :]
                    reason = RequestStatus.FINISHED_STOPPED
                    break
        self.append_output_token_ids(tokens)
        return reason, tokens

    def append_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append tokens; hash only when a block completes (mutates)."""
        all_ids = self.all_token_ids
        all_ids.extend(token_ids)
        hasher = self.hasher
        if hasher is not None and len(all_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            hasher.extend(self.block_hashes, all_ids, self.extras)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, in_flight={self.num_in_flight_tokens})"
        )
