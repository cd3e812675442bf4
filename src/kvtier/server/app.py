"""FastAPI routes of the OpenAI-compatible server. Handlers validate, hand requests to the
`EngineClient` (the engine on a thread, or in a process of its own) and shape its events into
OpenAI responses; they never touch the engine."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import kvtier
from kvtier.engine.params import SamplingParams
from kvtier.server.body_limit import BodyLimit
from kvtier.server.events import Delta, EngineClient, TokenLogprob
from kvtier.server.generation import ClientDisconnected, Generation, collect, stream
from kvtier.server.prompts import Prompt, PromptTokens, encode, resolve_max_tokens
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    JSONBody,
    TokenizeRequest,
    check_text,
    finite_logprob,
    message_dicts,
    validation_error,
)

log = logging.getLogger("kvtier.server")


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason == "abort" else reason


def build_app(
    engine: EngineClient, served_model_name: str, max_request_body_bytes: int = 4 << 20
) -> FastAPI:
    """The HTTP app over a started `EngineClient`; `served_model_name` is the only model id, bodies
    over `max_request_body_bytes` get a 413."""
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None, default_response_class=JSONBody)
    app.state.engine = engine
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        # a bug of ours, logged with its traceback; the client still gets an OpenAI-shaped body
        log.error("unhandled error in a request handler", exc_info=exc)
        return APIError(f"internal error: {exc}", 500, kind="server_error").response()

    @app.exception_handler(ClientDisconnected)
    async def gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        return APIError(str(exc.detail), exc.status_code, headers=headers).response()

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
        reason = engine.unhealthy()  # failed, exited, hung or stopped (a heartbeat's age)
        if reason is not None:
            raise APIError(reason, 503, kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> Response:  # a plain def: an engine in another process answers over a pipe
        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    card = {
        "id": served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kvtier",
        "max_model_len": engine.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card

    async def encode_all(prompts: list[Prompt], add_generation_prompt: bool) -> list[PromptTokens]:
        """Token ids of every prompt, computed in a worker thread (never the engine's)."""
        tok, vocab = engine.tokenizer, engine.vocab_size
        assert tok is not None, "the engine loop is started before the app serves"
        return await asyncio.to_thread(
            lambda: [encode(tok, p, vocab, add_generation_prompt) for p in prompts]
        )

    def requests(
        encoded: list[PromptTokens],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        params: tuple[str, str],
        num_logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> list[tuple[list[int], SamplingParams]]:
        """One (token ids, parameters) per choice: `body.n` per prompt, in choice order."""
        out = []
        for e in encoded:
            limit = resolve_max_tokens(len(e.token_ids), max_tokens, engine.max_model_len, *params)
            for i in range(body.n):
                sp = body.sampling_params(limit, num_logprobs, i, prompt_logprobs)
                out.append((e.token_ids, sp))
        return out

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response | dict[str, Any]:
        check_text(body.model_dump(exclude_unset=True), "")
        check_model(body.model)
        body.check_unsupported()
        # vLLM: echo with max_tokens=0 returns the prompt (one token is computed, not shown),
        # and echo asks for the prompt's logprobs too.
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if echo_only else body.max_tokens
        check_max_tokens(max_tokens, "max_tokens")
        prompts: list[Prompt] = list(body.prompts())
        encoded = await encode_all(prompts, True)
        prompt_logprobs = body.logprobs if body.echo else None
        params = ("prompt", "max_tokens")
        todo = requests(encoded, body, max_tokens, params, body.logprobs, prompt_logprobs)
        gen = Generation(engine, "cmpl", [e.text or "" for e in encoded], body.n)
        await gen.start(todo, body.priority)
        head = {"id": gen.id, "object": "text_completion", "created": gen.created}
        head["model"] = body.model
        offsets = [0] * len(gen.texts)

        def choice(
            i: int,
            prefix: str,
            text: str,
            lps: list[TokenLogprob] | None,
            reason: str | None,
            prompt_lps: list[TokenLogprob] | None = None,
        ) -> dict[str, Any]:
            logprobs = None
            if echo_only:
                text, lps = "", []
            if body.logprobs is not None and prompt_lps is not None:  # with the echoed prefix
                logprobs = completion_logprobs(prompt_lps + (lps or []), offsets[i])
            elif body.logprobs is not None:
                logprobs = completion_logprobs(lps or [], offsets[i] + len(prefix))
            offsets[i] += len(prefix) + len(text)
            reason = _finish_reason(reason)
            return {
                "index": i,
                "text": prefix + text,
                "logprobs": logprobs,
                "finish_reason": reason,
            }

        if body.stream:
            echoed: set[int] = set()

            def chunk(i: int, d: Delta) -> dict[str, Any]:
                first = body.echo and i not in echoed
                prefix = gen.prompt_texts[i] if first else ""
                echoed.add(i)
                prompt_lps = d.prompt_logprobs if first else None
                c = choice(i, prefix, d.text, d.logprobs, d.finish_reason, prompt_lps)
                return head | {"choices": [c]}

            return stream(gen, raw, chunk, head if body.include_usage else None)
        await collect(gen, raw)
        choices = []
        for i, text in enumerate(gen.texts):
            prefix = gen.prompt_texts[i] if body.echo else ""
            prompt_lps = gen.prompt_logprobs[i] if body.echo else None
            c = choice(i, prefix, text, gen.logprobs[i], gen.finish[i], prompt_lps)
            choices.append(c | {"stop_reason": gen.stop_reasons[i]})
        return head | {"choices": choices, "usage": gen.usage_body()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response | dict[str, Any]:
        check_text(body.model_dump(exclude_unset=True), "")
        check_model(body.model)
        body.check_unsupported()
        max_tokens = body.requested_max_tokens()
        max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        check_max_tokens(max_tokens, max_param)
        num_logprobs = body.num_logprobs()
        encoded = await encode_all([body.dict_messages()], body.add_generation_prompt)
        todo = requests(encoded, body, max_tokens, ("messages", max_param), num_logprobs)
        gen = Generation(engine, "chatcmpl", [e.text or "" for e in encoded], body.n)
        await gen.start(todo, body.priority)
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        head = {"id": gen.id, "object": kind, "created": gen.created, "model": body.model}

        def logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
            return None if num_logprobs is None else chat_logprobs(lps or [])

        if body.stream:
            greeted: set[int] = set()

            def chunk(i: int, d: Delta) -> dict[str, Any]:
                delta: dict[str, Any] = {"content": d.text}
                if i not in greeted:  # each choice's first delta carries the role
                    greeted.add(i)
                    delta["role"] = "assistant"
                c = {"index": i, "delta": delta, "logprobs": logprobs(d.logprobs)}
                return head | {"choices": [c | {"finish_reason": _finish_reason(d.finish_reason)}]}

            return stream(gen, raw, chunk, head if body.include_usage else None)
        await collect(gen, raw)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs(gen.logprobs[i]),
                "finish_reason": _finish_reason(gen.finish[i]),
                "stop_reason": gen.stop_reasons[i],
            }
            for i, text in enumerate(gen.texts)
        ]
        return head | {"choices": choices, "usage": gen.usage_body()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_text(body.model_dump(exclude_unset=True), "")
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send exactly one of `prompt` and `messages`")
        prompt: Prompt = (
            body.prompt if body.prompt is not None else message_dicts(body.messages or [])
        )
        tok = engine.tokenizer
        assert tok is not None
        ids = (
            await asyncio.to_thread(
                encode,
                tok,
                prompt,
                engine.vocab_size,
                body.add_generation_prompt,
                body.add_special_tokens,
            )
        ).token_ids
        strs = [tok.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model)
        if any(not 0 <= t < engine.vocab_size for t in body.tokens):
            raise APIError(f"token ids must lie in [0, {engine.vocab_size})", param="tokens")
        tok = engine.tokenizer
        assert tok is not None
        text = await asyncio.to_thread(tok.decode, body.tokens, False)  # specials kept (vLLM)
        return {"prompt": text}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": kvtier.__version__}

    return app


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else finite_logprob(logprob)


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The `logprobs` object of a completion choice (legacy shape); -inf becomes -9999.0 and a
    prompt's first token has null entries."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [
            None if lp.logprob is None else {t: finite_logprob(v) for t, v in lp.top} for lp in lps
        ],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """The `logprobs` object of a chat choice; -inf becomes -9999.0."""

    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    content = [
        entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content}
