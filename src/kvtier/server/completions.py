"""The generation routes, `/v1/completions` and `/v1/chat/completions`: validate a body, tokenize
it off the engine thread, submit its choices to the `EngineClient` and shape the events into
OpenAI responses, whole or streamed; and their render routes (vLLM's `…/render`), which stop
after tokenizing and return what would be submitted."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtier.engine.params import SamplingParams
from kvtier.server.errors import APIError, JSONBody, check_text
from kvtier.server.events import Delta, EngineClient, TokenLogprob
from kvtier.server.generation import Generation, collect, stream
from kvtier.server.info import check_model
from kvtier.server.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from kvtier.server.prompts import (
    ChatOptions,
    Prompt,
    PromptTokens,
    check_admissible,
    check_response_size,
    encode,
    resolve_max_tokens,
)
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.server.tools import ToolConfig, constrain, plan_tools, template_tools


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason == "abort" else reason


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise APIError(f"{param} must be at least 1, got {value}", param=param)


async def _encode_all(
    engine: EngineClient,
    prompts: list[Prompt],
    max_tokens: int | None,
    add_special_tokens: bool | None,
    truncate_prompt_tokens: int | None,
    chat: ChatOptions | None = None,
) -> list[PromptTokens]:
    """Token ids of every prompt, computed in a worker thread (never the engine's); a text
    that cannot fit is refused before it is tokenized whole."""
    tok, vocab, limit = engine.tokenizer, engine.vocab_size, engine.max_model_len
    assert tok is not None, "the engine loop is started before the app serves"
    if truncate_prompt_tokens is not None and truncate_prompt_tokens >= limit:
        raise APIError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} leaves no room for output in "
            f"this model's maximum context length of {limit} tokens; send a smaller value",
            param="truncate_prompt_tokens",
        )

    def run() -> list[PromptTokens]:
        return [
            encode(
                tok,
                p,
                vocab,
                add_special_tokens=add_special_tokens,
                max_model_len=limit,
                max_tokens=max_tokens,
                truncate_prompt_tokens=truncate_prompt_tokens,
                chat=chat,
            )
            for p in prompts
        ]

    return await asyncio.to_thread(run)


def _requests(
    encoded: list[PromptTokens],
    body: CompletionRequest | ChatCompletionRequest,
    limits: list[int],
    vocab_size: int,
    num_logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> list[tuple[list[int], SamplingParams]]:
    """One (token ids, parameters) per choice: `body.n` per prompt, in choice order."""
    out = []
    bias = body.token_bias(vocab_size)
    for e, limit in zip(encoded, limits, strict=True):
        for i in range(body.n):
            sp = body.sampling_params(limit, num_logprobs, i, prompt_logprobs, bias)
            out.append((e.token_ids, sp))
    return out


def _specials(body: CompletionRequest | ChatCompletionRequest) -> bool | None:
    """The body's add_special_tokens when sent; None keeps the default (text gets them, a
    chat template writes its own)."""
    return body.add_special_tokens if "add_special_tokens" in body.model_fields_set else None


def _check_completion(
    body: CompletionRequest, served_model_name: str
) -> tuple[int | None, list[Prompt]]:
    """A completion body's checks before tokenizing; returns its max_tokens and prompts."""
    check_text(body.model_dump(exclude_unset=True), "")
    check_model(body.model, served_model_name)
    body.check_unsupported()
    # vLLM: echo with max_tokens=0 returns the prompt (one token is computed, not shown),
    # and echo asks for the prompt's logprobs too.
    echo_only = bool(body.echo) and body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens
    _check_max_tokens(max_tokens, "max_tokens")
    return max_tokens, list(body.prompts())


async def _completion_tokens(
    engine: EngineClient, body: CompletionRequest, prompts: list[Prompt], max_tokens: int | None
) -> tuple[list[PromptTokens], list[int]]:
    """Each prompt's token ids and the max_tokens each leaves room for."""
    encoded = await _encode_all(
        engine, prompts, max_tokens, _specials(body), body.truncate_prompt_tokens
    )
    params = ("prompt", "max_tokens")
    limits = [
        resolve_max_tokens(len(e.token_ids), max_tokens, engine.max_model_len, *params)
        for e in encoded
    ]
    return encoded, limits


def _max_param(body: ChatCompletionRequest) -> str:
    return "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"


def _check_chat(body: ChatCompletionRequest, served_model_name: str) -> int | None:
    """A chat body's checks before rendering; returns its max_tokens."""
    check_text(body.model_dump(exclude_unset=True), "")
    check_model(body.model, served_model_name)
    body.check_unsupported()
    max_tokens = body.requested_max_tokens()
    _check_max_tokens(max_tokens, _max_param(body))
    return max_tokens


async def _chat_tokens(
    engine: EngineClient, body: ChatCompletionRequest, max_tokens: int | None
) -> tuple[list[PromptTokens], int]:
    """The rendered conversation's token ids (the request's tools shown to the template) and
    the max_tokens it leaves room for."""
    opts = ChatOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        template_tools(body),
    )
    messages = body.dict_messages()
    encoded = await _encode_all(
        engine, [messages], max_tokens, _specials(body), body.truncate_prompt_tokens, opts
    )
    limit = resolve_max_tokens(
        len(encoded[0].token_ids), max_tokens, engine.max_model_len, "messages", _max_param(body)
    )
    return encoded, limit


def _rendered(
    request_id: str,
    token_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    params: SamplingParams,
) -> dict[str, Any]:
    """One prompt as vLLM's render endpoints return it (its `GenerateRequest`): what a
    generate call would be sent, token ids first; kvtier has no multimodal features."""
    sampling = {"n": body.n} | {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()
    }
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling,
        "model": body.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(body.stream),
        "stream_options": (
            body.stream_options.model_dump()
            if body.stream and body.stream_options is not None
            else None
        ),
        "cache_salt": None,
        "priority": body.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def render_routes(engine: EngineClient, served_model_name: str) -> APIRouter:
    """vLLM's `/v1/completions/render` (a list, one entry per prompt) and
    `/v1/chat/completions/render` (one entry): the token ids the generation routes would hand
    the engine for the same body, through the same checks and tokenization, generating nothing
    (vllm-router's kv_aware policy reads them to match prefixes)."""
    router = APIRouter(default_response_class=JSONBody)

    @router.post("/v1/completions/render", response_model=None)
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        max_tokens, prompts = _check_completion(body, served_model_name)
        encoded, limits = await _completion_tokens(engine, body, prompts, max_tokens)
        base = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        return [
            _rendered(
                base if len(encoded) == 1 else f"{base}-{i}",
                list(e.token_ids),
                body,
                body.sampling_params(
                    limit,
                    body.logprobs,
                    0,
                    body.num_prompt_logprobs(),
                    body.token_bias(engine.vocab_size),
                ),
            )
            for i, (e, limit) in enumerate(zip(encoded, limits, strict=True))
        ]

    @router.post("/v1/chat/completions/render", response_model=None)
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        max_tokens = _check_chat(body, served_model_name)
        encoded, limit = await _chat_tokens(engine, body, max_tokens)
        bias = body.token_bias(engine.vocab_size)
        params = body.sampling_params(limit, body.num_logprobs(), 0, body.prompt_logprobs, bias)
        request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        return _rendered(request_id, list(encoded[0].token_ids), body, params)

    return router


def completion_routes(
    engine: EngineClient, served_model_name: str, tool_config: ToolConfig | None = None
) -> APIRouter:
    """`/v1/completions` and `/v1/chat/completions` over a started `engine`; a body naming a model
    other than `served_model_name` gets a 404; `tool_config`: the server's tool flags."""
    tool_config = tool_config or ToolConfig()
    router = APIRouter(default_response_class=JSONBody)
    # the most requests the engine ever holds: more choices in one request can never be admitted
    max_unfinished = engine.args.scheduler.max_num_seqs + engine.max_waiting_requests

    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response | dict[str, Any]:
        max_tokens, prompts = _check_completion(body, served_model_name)
        echo_only = bool(body.echo) and body.max_tokens == 0
        check_admissible(len(prompts) * body.n, max_unfinished, body.n)
        prompt_logprobs = body.num_prompt_logprobs()
        returns_prompt = bool(body.echo) or prompt_logprobs is not None
        if max_tokens is not None:  # up front: before a single prompt is tokenized
            check_response_size(body.n, [max_tokens] * len(prompts), None, body.logprobs, None)
        encoded, limits = await _completion_tokens(engine, body, prompts, max_tokens)
        lengths = [len(e.token_ids) for e in encoded] if returns_prompt else None
        check_response_size(body.n, limits, lengths, body.logprobs, prompt_logprobs)
        todo = _requests(encoded, body, limits, engine.vocab_size, body.logprobs, prompt_logprobs)
        texts = [e.text or "" for e in encoded]
        gen = Generation(engine, "cmpl", texts, body.n, body.request_id)
        await gen.start(todo, body.priority)
        head = {"id": gen.id, "object": "text_completion", "created": gen.created}
        head["model"] = body.model or served_model_name
        offsets = [0] * len(gen.texts)
        as_ids = bool(body.return_tokens_as_token_ids)
        # the legacy logprobs carry the echoed prompt's only when echo asked for them
        echo_lps = bool(body.echo) and body.logprobs is not None

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
            if echo_lps and prompt_lps is not None:  # with the echoed prefix
                logprobs = completion_logprobs(prompt_lps + (lps or []), offsets[i], as_ids)
            elif body.logprobs is not None:
                logprobs = completion_logprobs(lps or [], offsets[i] + len(prefix), as_ids)
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
                first = bool(body.echo) and i not in echoed
                prefix = gen.prompt_texts[i] if first else ""
                echoed.add(i)
                prompt_lps = d.prompt_logprobs if first else None
                c = choice(i, prefix, d.text, d.logprobs, d.finish_reason, prompt_lps)
                out = head | {"choices": [c]}
                return out | {"usage": gen.choice_usage(i)} if body.continuous_usage else out

            return stream(gen, raw, chunk, head if body.include_usage else None)
        await collect(gen, raw)
        choices = []
        for i, text in enumerate(gen.texts):
            prefix = gen.prompt_texts[i] if body.echo else ""
            prompt_lps = gen.prompt_logprobs[i] if body.echo else None
            c = choice(i, prefix, text, gen.logprobs[i], gen.finish[i], prompt_lps)
            c["stop_reason"] = gen.stop_reasons[i]
            if body.prompt_logprobs is not None:
                c["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs[i] or [])
            choices.append(c)
        return head | {"choices": choices, "usage": gen.usage_body()}

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response | dict[str, Any]:
        max_tokens = _check_chat(body, served_model_name)
        plan = plan_tools(body, tool_config)
        num_logprobs = body.num_logprobs()
        check_admissible(body.n, max_unfinished, body.n)
        if max_tokens is not None:  # up front: before the prompt is rendered and tokenized
            check_response_size(body.n, [max_tokens], None, num_logprobs, None)
        encoded, limit = await _chat_tokens(engine, body, max_tokens)
        lengths = None if body.prompt_logprobs is None else [len(encoded[0].token_ids)]
        check_response_size(body.n, [limit], lengths, num_logprobs, body.prompt_logprobs)
        skip = plan.skip_special_tokens
        todo = [
            (ids, constrain(replace(sp, skip_special_tokens=skip(sp.skip_special_tokens)), plan))
            for ids, sp in _requests(
                encoded, body, [limit], engine.vocab_size, num_logprobs, body.prompt_logprobs
            )
        ]
        gen = Generation(
            engine, "chatcmpl", [e.text or "" for e in encoded], body.n, body.request_id
        )
        await gen.start(todo, body.priority)
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        model_name = body.model or served_model_name
        head = {"id": gen.id, "object": kind, "created": gen.created, "model": model_name}
        as_ids = bool(body.return_tokens_as_token_ids)

        def logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
            return None if num_logprobs is None else chat_logprobs(lps or [], as_ids)

        if body.stream:
            greeted: set[int] = set()
            calls = [plan.stream() for _ in gen.texts]  # per choice, when tool calls are parsed

            def chunk(i: int, d: Delta) -> list[dict[str, Any]]:
                content, tool_deltas = d.text, list[dict[str, Any]]()
                streamer = calls[i]
                if streamer is not None:  # the text so far, held back while it may be a call
                    content, tool_deltas = streamer.feed(gen.texts[i], d.finish_reason is not None)
                delta: dict[str, Any] = {"content": content}
                if i not in greeted:  # each choice's first delta carries the role
                    greeted.add(i)
                    delta["role"] = "assistant"
                out = []
                if content or len(delta) > 1 or not tool_deltas or d.logprobs:
                    out.append({"index": i, "delta": delta, "logprobs": logprobs(d.logprobs)})
                for tool_delta in tool_deltas:  # one call's head or fragment per chunk (OpenAI)
                    out.append({"index": i, "delta": {"tool_calls": [tool_delta]}})
                reason = _finish_reason(d.finish_reason)
                if reason == "stop" and streamer is not None and streamer.num_calls:
                    reason = "tool_calls"
                for c in out:
                    c.setdefault("logprobs", None)
                    c["finish_reason"] = None
                out[-1]["finish_reason"] = reason
                usage = {"usage": gen.choice_usage(i)} if body.continuous_usage else {}
                return [head | {"choices": [c]} | usage for c in out]

            return stream(gen, raw, chunk, head if body.include_usage else None)
        await collect(gen, raw)
        choices = []
        for i, text in enumerate(gen.texts):
            message, reason = plan.message(text, _finish_reason(gen.finish[i]))
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs(gen.logprobs[i]),
                    "finish_reason": reason,
                    "stop_reason": gen.stop_reasons[i],
                }
            )
        out = head | {"choices": choices, "usage": gen.usage_body()}
        if body.prompt_logprobs is not None:  # vLLM: beside the choices, one list per request
            out["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs[0] or [])
        return out

    return router
