"""One HTTP request's generation: its sub-requests (one per prompt) on the engine loop, their
merged events, and the two ways to deliver them (collected, or streamed as SSE), each aborting the
sub-requests when the client disconnects."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvtier.engine.params import SamplingParams
from kvtier.server.errors import APIError, dumps
from kvtier.server.events import (
    Delta,
    EngineClient,
    Event,
    Failed,
    Sink,
    Started,
    Submission,
    TokenLogprob,
)


class Generation:
    """The sub-requests of one HTTP request and their merged event queue: `n` choices per
    prompt, choice `prompt_index * n + i` (OpenAI's indexing)."""

    def __init__(
        self,
        engine: EngineClient,
        prefix: str,
        prompt_texts: list[str],
        n: int = 1,
        request_id: str | None = None,
    ) -> None:
        num = len(prompt_texts) * n
        self.engine = engine
        self.n = n
        # vLLM's `request_id` names the response; the engine's ids stay unique whatever it is
        own = uuid.uuid4().hex
        self.id = f"{prefix}-{request_id or own}"
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.req_ids = [f"{prefix}-{own}-{i}" for i in range(num)]
        self.num_prompt_tokens = [0] * num  # per choice, from its `Started`
        self.num_tokens = [0] * num  # per choice, generated so far
        self.prompt_texts = [text for text in prompt_texts for _ in range(n)]  # per choice
        self.texts = [""] * num
        self.finish: list[str | None] = [None] * num
        self.stop_reasons: list[str | int | None] = [None] * num
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(num)]
        self.prompt_logprobs: list[list[TokenLogprob] | None] = [None] * num
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.early: list[tuple[int, Delta]] = []

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def abort_unfinished(self) -> None:
        for rid, fin in zip(self.req_ids, self.finish):
            if fin is None:
                self.engine.abort(rid)

    async def start(self, requests: list[tuple[list[int], SamplingParams]], priority: int) -> None:
        """Submit one engine request per choice (token ids, parameters); return once all are
        admitted, or raise the first refusal (aborting the others)."""
        loop = asyncio.get_running_loop()
        for i, (rid, (token_ids, params)) in enumerate(zip(self.req_ids, requests, strict=True)):
            sink = Sink.on_loop(loop, self.queue, i)
            self.engine.submit(Submission(rid, token_ids, params, sink, priority))
        started = 0
        while started < len(requests):
            i, ev = await self.queue.get()
            if isinstance(ev, Failed):
                self.finish[i] = "error"
                self.abort_unfinished()
                raise ev.error
            if isinstance(ev, Started):
                self.num_prompt_tokens[i] = ev.num_prompt_tokens
                started += 1
            else:
                self.early.append((i, ev))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        pending, self.early = self.early, []
        for item in pending:
            yield self._note(*item)
        while not self.done:
            i, ev = await self.queue.get()
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Delta):
                yield self._note(i, ev)

    def _note(self, i: int, d: Delta) -> tuple[int, Delta]:
        self.texts[i] += d.text
        self.num_tokens[i] += len(d.token_ids)
        self.logprobs[i] += d.logprobs or []
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[i] = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish[i], self.stop_reasons[i] = d.finish_reason, d.stop_reason
        if d.usage is not None:
            if i % self.n == 0:  # a prompt counts once, however many choices (as vLLM)
                self.usage["prompt_tokens"] += d.usage.prompt_tokens
                self.usage["cached_tokens"] += d.usage.cached_tokens
            self.usage["completion_tokens"] += d.usage.completion_tokens
        return i, d

    def choice_usage(self, i: int) -> dict[str, Any]:
        """Choice `i`'s usage so far (vLLM's `continuous_usage_stats` chunk field)."""
        p, c = self.num_prompt_tokens[i], self.num_tokens[i]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def usage_body(self) -> dict[str, Any]:
        u = self.usage
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
        }


class ClientDisconnected(Exception):
    """The client went away before its whole answer was ready (the app answers it with nothing)."""


async def until_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: Generation, raw: Request) -> None:
    """Run a generation to its end; abort it if the client goes away first."""

    async def drain() -> None:
        async for _ in gen.deltas():
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(until_disconnect(raw))
    done: set[asyncio.Future[None]] = set()
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            gen.abort_unfinished()
    if work not in done:
        raise ClientDisconnected  # nobody to answer; the cancelled drain ends quietly
    try:
        work.result()  # re-raises an engine failure
    except APIError as exc:
        exc.admitted = True  # not a refusal: the request ran
        raise


def sse(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"


def stream(
    gen: Generation,
    raw: Request,
    chunk: Callable[[int, Delta], dict[str, Any] | list[dict[str, Any]]],
    usage_head: dict[str, Any] | None,
) -> StreamingResponse:
    """SSE of `chunk(index, delta)` per delta (one chunk, or several: a tool call's pieces), then
    (if `usage_head`) a usage chunk, then [DONE]."""

    async def events() -> AsyncIterator[str]:
        def on_disconnect(task: asyncio.Future[None]) -> None:
            if not task.cancelled():
                gen.abort_unfinished()

        watch = asyncio.ensure_future(until_disconnect(raw))
        watch.add_done_callback(on_disconnect)
        try:
            async for i, d in gen.deltas():
                shaped = chunk(i, d)
                for c in shaped if isinstance(shaped, list) else [shaped]:
                    yield sse(c)
            if usage_head is not None:
                yield sse(usage_head | {"choices": [], "usage": gen.usage_body()})
            yield "data: [DONE]\n\n"
        except APIError as exc:  # headers are out: the error is an event, then [DONE] (as vLLM)
            yield sse(exc.body())
            yield "data: [DONE]\n\n"
        finally:
            watch.cancel()
            gen.abort_unfinished()

    return StreamingResponse(events(), media_type="text/event-stream")
