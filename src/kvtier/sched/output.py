"""Step contracts between scheduler and runner: `SchedulerOutput` in, `RunnerOutput` back.

Plain data only; new requests are sent whole, running ones as a diff against what the runner holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.ids import BlockId, ReqId
from kvtier.sampling import DrawParams, StopConditions
from kvtier.sched.request import RequestStatus

BlockIds = tuple[list[BlockId], ...]  # one list of block ids per KV-cache group


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for (first schedule, or resumed after preemption)."""

    req_id: ReqId
    token_ids: list[int]  # every known token: prompt, plus outputs of a resumed request
    num_prompt_tokens: int  # prefix of token_ids that is prompt
    stop: StopConditions  # what the runner needs of them: min_tokens and stop ids (masking)
    draw: DrawParams  # how to draw its tokens, which logprobs to return
    block_ids: BlockIds  # the whole block table per group (null block = id 0 where skipped)
    num_computed_tokens: int  # tokens already in KV (prefix hit); this step starts there


@dataclass(slots=True)
class CachedRequestData:
    """A running request the runner already holds: only what changed."""

    req_id: ReqId
    new_block_ids: BlockIds  # ids appended to each group's table this step (0 = skipped, null)
    num_computed_tokens: int  # optimistic start position (≥ the device's, after rejections)
    # lowest start the device may have: minus this request's drafts still unverified at launch
    lowest_start: int


@dataclass(slots=True)
class PlannedTransfer:
    """A block copy between tiers planned with this step (filled by the offload layer)."""

    transfer_id: int  # unique per engine; completions and failures are reported by it
    req_id: ReqId  # request the copy serves
    src_block_ids: list[int]  # source blocks in the source tier
    dst_block_ids: list[int]  # destination blocks in the destination tier
    is_load: bool  # host → device (True) or device → host (False)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs to execute step `step_seq`."""

    step_seq: int  # sched_step_seq of this step (1, 2, ...); updates must come in this order
    scheduled_new_reqs: list[NewRequestData]  # sent whole
    scheduled_cached_reqs: list[CachedRequestData]  # sent as a diff
    num_scheduled_tokens: dict[ReqId, int]  # tokens per request, drafts included
    total_num_scheduled_tokens: int  # Σ num_scheduled_tokens
    scheduled_spec_decode_tokens: dict[ReqId, list[int]]  # draft ids; -1 = runner proposes
    preempted_req_ids: list[ReqId]  # runner drops their state (they return as new requests)
    finished_req_ids: list[ReqId]  # finished or aborted since the previous step
    planned_transfers: list[PlannedTransfer] = field(default_factory=list)  # offload copies

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of a token (sampled, or of the prompt) and the top candidates at its position."""

    logprob: float
    top: dict[int, float]  # candidate token id -> its logprob


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions start, start + 1, ... (one step's chunk)."""

    start: int  # ≥ 1: the first prompt token has no logprob
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class RunnerOutput:
    """What executing step `step_seq` produced."""

    step_seq: int  # the SchedulerOutput.step_seq this answers
    # Per request that sampled: accepted drafts then one bonus token (≥ 1 token). Requests of a
    # non-final prefill chunk are absent (or map to an empty list).
    sampled_token_ids: dict[ReqId, list[int]]
    # Transfers (by transfer_id, of this or any earlier step) whose copy has completed, or failed.
    finished_transfers: list[int] = field(default_factory=list)
    failed_transfers: list[int] = field(default_factory=list)
    # Per request that asked (DrawParams.logprobs): one entry per sampled token, in order.
    logprobs: dict[ReqId, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request that asked (DrawParams.prompt_logprobs): the prompt positions this step's
    # chunk predicted.
    prompt_logprobs: dict[ReqId, PromptLogprobs] = field(default_factory=dict)
    num_draft_tokens: int = 0  # drafts verified in this step
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(slots=True)
class RequestUpdate:
    """Tokens a request gained in one update, and its finish status once it ends."""

    req_id: ReqId  # the request
    new_token_ids: list[int]  # tokens appended to its output this update
    finished: RequestStatus | None  # the finished status, or None while it runs
