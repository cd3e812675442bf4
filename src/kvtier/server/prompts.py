"""Prompts → token ids on the HTTP side (text, token ids, or chat messages through the template),
with the context-length checks. Called in a worker thread (`asyncio.to_thread`), so the engine
thread only ever receives token ids; the tokenizer releases the GIL while it encodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.model.tokenizer import Tokenizer
from kvtier.server.protocol import APIError, render_default_chat

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass(frozen=True, slots=True)
class Encoded:
    text: str  # the prompt as text (echo)
    token_ids: list[int]


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_gen: bool) -> str:
    """The tokenizer's chat template, or the plain `role: text` one; APIError on template errors."""
    try:
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(messages, add_gen)
        return render_default_chat(messages, add_gen)
    except Exception as exc:  # template errors are the request's fault
        raise APIError(f"chat template: {exc}", param="messages") from None


def encode(
    tokenizer: Tokenizer,
    prompt: Prompt,
    vocab_size: int,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
) -> Encoded:
    """Token ids of one prompt; APIError (400) for empty prompts and ids outside the vocabulary.
    `add_special_tokens=None`: text gets them, a chat template writes its own (the plain
    template gets the tokenizer's, as `generate` does)."""
    if isinstance(prompt, str):
        special = True if add_special_tokens is None else add_special_tokens
        return Encoded(prompt, tokenizer.encode(prompt, add_special_tokens=special))
    if prompt and isinstance(prompt[0], dict):
        messages: list[dict[str, Any]] = prompt
        text = render_chat(tokenizer, messages, add_generation_prompt)
        special = not tokenizer.chat_template if add_special_tokens is None else add_special_tokens
        return Encoded(text, tokenizer.encode(text, add_special_tokens=special))
    ids: list[int] = prompt  # type: ignore[assignment]
    if not ids:
        raise APIError("prompt must not be empty", param="prompt")
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    return Encoded(tokenizer.decode(ids), list(ids))


def resolve_max_tokens(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """`max_tokens`, or all the room left when None; APIError (400) when the prompt and the
    completion do not fit in `max_model_len`. `param` names the prompt field."""
    n, limit = num_prompt_tokens, max_model_len
    if n >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {n} tokens, leaving no room for output. Please shorten your prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - n
    if max_tokens > limit - n:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the prompt or max_tokens.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens
