"""The engine's books per request (`RequestState`) and what it hands its callers: a `StepOutput`
per request per step, the last one carrying the `FinishedRequest`. `EngineCore` forgets a request
when it hands out its `FinishedRequest`; callers never hold or remove engine state."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.params import SamplingParams
from kvtier.model import IncrementalDetokenizer
from kvtier.sched.output import PromptLogprobs, TokenLogprobs
from kvtier.sched.request import Request, RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request as it ended: the whole output, why it ended, and what it asked for."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token kept
    text: str  # their text (a stop string excluded unless include_stop_str_in_output)
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: str | int | None  # the stop string or stop token that ended it (vLLM's)
    num_cached_tokens: int  # prompt tokens served by a prefix hit at first admission
    num_external_cached_tokens: int  # of which loaded from a tier below the device
    num_preemptions: int  # times it was preempted (and recomputed)
    logprobs: list[TokenLogprobs] | None  # one per output token, when asked
    # One per prompt position when asked (the first is None, as vLLM), else None.
    prompt_logprobs: list[TokenLogprobs | None] | None
    scheduled_time: float | None = None  # `RequestState.scheduled_time`


@dataclass(slots=True)
class StepOutput:
    """What one request gained in one engine step; `result` is set on its last."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    new_logprobs: list[TokenLogprobs] | None = None  # of `new_token_ids`, when asked
    # Every prompt position's logprobs, complete, on the request's first output (when asked).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    result: FinishedRequest | None = None


@dataclass(slots=True)
class RequestState:
    """Engine-side view of one request: its text so far and what the user asked for."""

    req_id: str  # the caller's (`request.request_id` is the scheduler's: see `EngineCore`)
    request: Request
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One entry per prompt position when asked (the first stays None, as vLLM), else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # handed out with the first output
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # time.monotonic() when a step first scheduled it (None until then): the end of its queue
    # time and the start of its prefill, as vLLM's metrics split a request's latency
    scheduled_time: float | None = None

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Record a chunk's prompt logprobs (mutates); positions already known stay as they are
        (a request preempted during its prefill computes them again)."""
        known = self.prompt_logprobs
        assert known is not None, f"{self.request.request_id} did not ask for prompt logprobs"
        for pos, lp in enumerate(chunk.logprobs, chunk.start):
            if known[pos] is None:
                known[pos] = lp

    def finished(self) -> FinishedRequest:
        """The request as it ended (after `finish_reason` is set; copies the lists)."""
        assert self.finish_reason is not None, f"{self.request.request_id} has not finished"
        request = self.request
        asked = self.params.logprobs is not None
        prompt = self.prompt_logprobs
        return FinishedRequest(
            req_id=self.req_id,
            prompt_token_ids=request.all_token_ids[: request.num_prompt_tokens],
            token_ids=list(self.token_ids),
            text=self.detok.text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_external_cached_tokens=request.num_external_cached_tokens,
            num_preemptions=request.num_preemptions,
            logprobs=list(self.logprobs) if asked else None,
            prompt_logprobs=None if prompt is None else list(prompt),
            scheduled_time=self.scheduled_time,
        )
