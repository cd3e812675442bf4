"""The engine's books per request (`RequestState`, kept in a `RequestBook` by both of its ids)
and what it hands its callers: a `StepOutput` per request per step, the last one carrying the
`FinishedRequest`. `EngineCore` forgets a request when it hands out its `FinishedRequest`; callers
never hold or remove engine state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.engine.params import SamplingParams
from kvtier.ids import ReqId
from kvtier.model import IncrementalDetokenizer
from kvtier.sampling import GrammarSpec
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


class RequestBook:
    """The requests added and whose final output is not handed out yet, by the id the scheduler
    knows each by and by the caller's id; and the grammars held for ids prepared, not yet added.
    The two ids differ only when a caller reuses an id while an aborted request's steps, load
    or stores still go by it (`sched_id`, architecture.md §Progress)."""

    def __init__(self) -> None:
        self._states: dict[ReqId, RequestState] = {}
        self._ids: dict[str, ReqId] = {}
        self._num_renamed = 0
        self._prepared: dict[str, GrammarSpec] = {}

    def __len__(self) -> int:
        return len(self._states)

    def in_use(self, req_id: str) -> bool:
        """Whether a request added by the caller's id `req_id` is unfinished or not handed out."""
        return req_id in self._ids

    def sched_id(self, req_id: str, held: Callable[[ReqId], bool]) -> ReqId:
        """The id for a new request of the caller's id `req_id`: that id, unless the layers below
        still hold it (`held`), then a fresh one."""
        sched_id = req_id
        while held(sched_id):
            self._num_renamed += 1
            sched_id = f"{req_id}#{self._num_renamed}"
        return sched_id

    def add(self, state: RequestState) -> None:
        self._states[state.request.request_id] = state
        self._ids[state.req_id] = state.request.request_id

    def get(self, sched_id: ReqId) -> RequestState | None:
        """The request the scheduler knows as `sched_id`, if still in the book."""
        return self._states.get(sched_id)

    def pop_caller(self, req_id: str) -> RequestState | None:
        """Take out the request of the caller's id `req_id` (None: unknown or handed out)."""
        sched_id = self._ids.pop(req_id, None)
        return None if sched_id is None else self._states.pop(sched_id)

    def remove(self, state: RequestState) -> None:
        """Take out a request whose final output is handed out."""
        del self._states[state.request.request_id]
        del self._ids[state.req_id]

    def prepare(self, req_id: str, spec: GrammarSpec | None) -> None:
        """Keep the grammar `spec` (None: the request has none) for `req_id` until its add or
        abort; ValueError if a grammar is kept for that id already."""
        if req_id in self._prepared:
            raise ValueError(f"request {req_id!r}: request id is already in use")
        if spec is not None:
            self._prepared[req_id] = spec

    def take_prepared(self, req_id: str) -> GrammarSpec | None:
        """The grammar prepared for `req_id` (None: none), no longer held here."""
        return self._prepared.pop(req_id, None)
