"""What crosses between the HTTP handlers and an engine: a `Submission` in, events out (`Started`,
then `Delta`s, or `Failed`) through the request's `Sink`, and `EngineClient`, what the app needs
of an engine host — `EngineLoop` (a thread of this process) or `EngineProcess` (a process of its
own) both provide it. A sink names its destination within an `Outlet`; an engine hands each
step's events to each outlet once (`put_all`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvtier.engine.params import EngineArgs, SamplingParams
from kvtier.server.errors import APIError

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore
    from kvtier.model.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Started:
    num_prompt_tokens: int


@dataclass(slots=True)
class TokenLogprob:
    """One token as text, its logprob and the top candidates (text, logprob), with their ids; a
    prompt's first token has neither (logprob None)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]
    token_id: int
    top_ids: list[int]  # the ids of `top`, in its order


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta of a request
    stop_reason: str | int | None = None
    usage: Usage | None = None  # set with finish_reason
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, when asked


@dataclass(slots=True)
class Failed:
    error: APIError


Event = Started | Delta | Failed


class Outlet(Protocol):
    """Where a step's events leave the engine thread: one `deliver` per outlet per step."""

    def deliver(self, batch: list[tuple[Any, Event]]) -> None:
        """Hand over (sink key, event) pairs; called on the engine thread, must not block."""


@dataclass(frozen=True, slots=True)
class LoopOutlet:
    """An HTTP loop in this process: events go onto asyncio queues with one wake-up of the loop
    per step (each `call_soon_threadsafe` writes the loop's self-pipe). Outlets of one loop are
    equal, so a step's events for every request on it travel together."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, batch: list[tuple[Any, Event]]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed HTTP loop (shutdown): nobody listens
            self.loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[tuple[asyncio.Queue[tuple[int, Event]], int], Event]]) -> None:
    for (queue_, index), event in batch:
        queue_.put_nowait((index, event))


@dataclass(slots=True)
class Sink:
    """Where one sub-request's events go: `key` names the destination within its outlet (for a
    `LoopOutlet`, an asyncio queue and the sub-request's index in it)."""

    outlet: Outlet
    key: Any

    @classmethod
    def on_loop(
        cls, loop: asyncio.AbstractEventLoop, queue_: asyncio.Queue[tuple[int, Event]], index: int
    ) -> Sink:
        return cls(LoopOutlet(loop), (queue_, index))

    def put(self, event: Event) -> None:
        put_all([(self, event)])


def put_all(events: list[tuple[Sink, Event]]) -> None:
    """Hand events to their sinks, one `deliver` per outlet."""
    by_outlet: dict[Outlet, list[tuple[Any, Event]]] = {}
    for sink, event in events:
        by_outlet.setdefault(sink.outlet, []).append((sink.key, event))
    for outlet, batch in by_outlet.items():
        outlet.deliver(batch)


@dataclass(slots=True)
class Submission:
    """A request as the HTTP layer hands it over: tokenized, its parameters built and its length
    checked there; the engine thread only admits it (or refuses it: queue full, engine error)."""

    req_id: str
    token_ids: list[int]
    params: SamplingParams
    sink: Sink
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)


class EngineClient(Protocol):
    """What the HTTP app needs of an engine: `EngineLoop` (the engine on a thread of this
    process) and `EngineProcess` (the engine in a process of its own) both provide it."""

    args: EngineArgs
    max_waiting_requests: int
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer | None
    layout_summary: str
    error: BaseException | None

    @property
    def is_alive(self) -> bool: ...

    def unhealthy(self) -> str | None:
        """Why `/health` answers 503 (`server/liveness.py`); None when healthy."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def on_failure(self, fn: Callable[[BaseException], None]) -> None: ...

    def submit(self, sub: Submission) -> None: ...

    def abort(self, req_id: str) -> None: ...

    def call(self, fn: Callable[[EngineCore], T], timeout: float = 30.0) -> T: ...

    def metrics_text(self) -> bytes: ...

    def rejected(self, status: int) -> None:
        """Count one HTTP request refused before admission, by its status (safe from any
        thread)."""


def engine_failed(exc: BaseException) -> APIError:
    return APIError(f"engine failed: {exc}", 500, kind="server_error")
