"""FastAPI routes of the OpenAI-compatible server. Handlers validate, hand requests to the
`EngineLoop` and shape its events into OpenAI responses; they never touch the engine."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvtier.engine.params import SamplingParams
from kvtier.server.engine_loop import Delta, EngineLoop, Event, Failed, Sink, Started, Submission
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)

Prompt = str | list[int] | list[dict[str, Any]]


class _Generation:
    """The sub-requests of one HTTP request (one per prompt) and their merged event queue."""

    def __init__(self, engine: EngineLoop, prefix: str, num: int) -> None:
        self.engine = engine
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.req_ids = [f"{self.id}-{i}" for i in range(num)]
        self.prompt_texts = [""] * num
        self.texts = [""] * num
        self.finish: list[str | None] = [None] * num
        self.stop_reasons: list[str | int | None] = [None] * num
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.early: list[tuple[int, Delta]] = []

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def abort_unfinished(self) -> None:
        for rid, fin in zip(self.req_ids, self.finish):
            if fin is None:
                self.engine.abort(rid)

    async def start(
        self, prompts: list[Prompt], submit: Callable[[str, Prompt, Sink], None]
    ) -> None:
        """Submit every prompt; return once all are admitted, or raise the first refusal."""
        loop = asyncio.get_running_loop()
        for i, (rid, prompt) in enumerate(zip(self.req_ids, prompts)):
            submit(rid, prompt, Sink(loop, self.queue, i))
        started = 0
        while started < len(prompts):
            i, ev = await self.queue.get()
            if isinstance(ev, Failed):
                self.finish[i] = "error"
                self.abort_unfinished()
                raise ev.error
            if isinstance(ev, Started):
                self.prompt_texts[i] = ev.prompt_text
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
        if d.finish_reason is not None:
            self.finish[i], self.stop_reasons[i] = d.finish_reason, d.stop_reason
        if d.usage is not None:
            self.usage["prompt_tokens"] += d.usage.prompt_tokens
            self.usage["completion_tokens"] += d.usage.completion_tokens
            self.usage["cached_tokens"] += d.usage.cached_tokens
        return i, d

    def usage_body(self) -> dict[str, Any]:
        u = self.usage
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
        }


async def _until_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: _Generation, raw: Request) -> None:
    """Run a generation to its end; abort it if the client goes away first."""

    async def drain() -> None:
        async for _ in gen.deltas():
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_until_disconnect(raw))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            gen.abort_unfinished()
    work.result()  # re-raises an engine failure


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _stream(
    gen: _Generation, raw: Request, chunk: Callable[[int, Delta], dict[str, Any]], usage: bool
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        def on_disconnect(task: asyncio.Future[None]) -> None:
            if not task.cancelled():
                gen.abort_unfinished()

        watch = asyncio.ensure_future(_until_disconnect(raw))
        watch.add_done_callback(on_disconnect)
        try:
            async for i, d in gen.deltas():
                yield _sse(chunk(i, d))
            if usage:
                yield _sse(chunk(-1, Delta("", [])) | {"choices": [], "usage": gen.usage_body()})
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            watch.cancel()
            gen.abort_unfinished()

    return StreamingResponse(events(), media_type="text/event-stream")


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason == "abort" else reason


def build_app(engine: EngineLoop, served_model_name: str) -> FastAPI:
    """The HTTP app over a started `EngineLoop`; `served_model_name` is the only model id."""
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(
                f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
            )

    def check_max_tokens(value: int | None, param: str) -> None:
        if value is not None and value < 1:
            raise APIError(f"{param} must be at least 1, got {value}", param=param)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise APIError(f"engine is not running: {engine.error}", 503, kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvtier",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response | dict[str, Any]:
        check_model(body.model)
        body.check_unsupported()
        check_max_tokens(body.max_tokens, "max_tokens")
        prompts: list[Prompt] = list(body.prompts())
        gen = _Generation(engine, "cmpl", len(prompts))
        await gen.start(prompts, _submitter(engine, body.max_tokens, body.sampling_params, body))
        head = {
            "id": gen.id,
            "object": "text_completion",
            "created": gen.created,
            "model": body.model,
        }

        def choice(i: int, text: str, reason: str | None) -> dict[str, Any]:
            return {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": _finish_reason(reason),
            }

        if body.stream:
            echoed: set[int] = set()

            def chunk(i: int, d: Delta) -> dict[str, Any]:
                text = d.text
                if body.echo and i not in echoed:
                    echoed.add(i)
                    text = gen.prompt_texts[i] + text
                return head | {"choices": [choice(i, text, d.finish_reason)]}

            return _stream(gen, raw, chunk, body.include_usage)
        await _collect(gen, raw)
        choices = []
        for i, text in enumerate(gen.texts):
            c = choice(i, (gen.prompt_texts[i] if body.echo else "") + text, gen.finish[i])
            choices.append(c | {"stop_reason": gen.stop_reasons[i]})
        return head | {"choices": choices, "usage": gen.usage_body()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response | dict[str, Any]:
        check_model(body.model)
        body.check_unsupported()
        max_tokens = body.requested_max_tokens()
        check_max_tokens(max_tokens, "max_completion_tokens")
        gen = _Generation(engine, "chatcmpl", 1)
        await gen.start(
            [body.dict_messages()], _submitter(engine, max_tokens, body.sampling_params, body)
        )
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = {"id": gen.id, "object": kind, "created": gen.created, "model": body.model}
        if body.stream:
            first = [True]

            def chunk(i: int, d: Delta) -> dict[str, Any]:
                delta: dict[str, Any] = {"content": d.text}
                if first[0]:
                    first[0] = False
                    delta["role"] = "assistant"
                reason = _finish_reason(d.finish_reason)
                return head | {
                    "choices": [
                        {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
                    ]
                }

            return _stream(gen, raw, chunk, body.include_usage)
        await _collect(gen, raw)
        message = {"role": "assistant", "content": gen.texts[0]}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": _finish_reason(gen.finish[0]),
            "stop_reason": gen.stop_reasons[0],
        }
        return head | {"choices": [choice], "usage": gen.usage_body()}

    return app


def _submitter(
    engine: EngineLoop,
    max_tokens: int | None,
    sampling: Callable[[int, int | None], SamplingParams],
    body: CompletionRequest | ChatCompletionRequest,
) -> Callable[[str, Prompt, Sink], None]:
    gen_prompt = getattr(body, "add_generation_prompt", True)

    def submit(req_id: str, prompt: Prompt, sink: Sink) -> None:
        engine.submit(
            Submission(
                req_id,
                prompt,
                max_tokens,
                lambda n: sampling(n, None),
                sink,
                add_generation_prompt=gen_prompt,
                priority=body.priority,
            )
        )

    return submit
