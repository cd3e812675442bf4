"""Prompts → token ids on the HTTP side: `engine/prompts.py` `encode_prompt` (the one front end,
shared with the offline `LLM`) with its errors as 400s naming `prompt` or `messages`, the
context-length check, and what one request may cost (choices it asks to hold, tokens it asks to
return). Called in a worker thread (`asyncio.to_thread`), so the engine thread only ever receives
token ids; the tokenizer releases the GIL while it encodes."""

from __future__ import annotations

from kvtier.engine.prompts import ChatOptions, Prompt, PromptTokens, PromptTooLong, encode_prompt
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.errors import APIError
from kvtier.server.protocol import MAX_RESPONSE_TOKENS

__all__ = [
    "ChatOptions",
    "Prompt",
    "PromptTokens",
    "check_admissible",
    "check_response_size",
    "encode",
    "resolve_max_tokens",
]


def encode(
    tokenizer: Tokenizer,
    prompt: Prompt,
    vocab_size: int,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
    *,
    max_model_len: int | None = None,
    max_tokens: int | None = None,
    truncate_prompt_tokens: int | None = None,
    chat: ChatOptions | None = None,
) -> PromptTokens:
    """Token ids of one prompt and its text (token ids are decoded for echo); APIError (400) for
    what `encode_prompt` refuses (empty prompts, ids outside the vocabulary, template errors).
    With `max_model_len`, a text that cannot leave room for `max_tokens` (at least one) is
    refused before it is tokenized whole."""
    is_chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    param = "messages" if is_chat else "prompt"
    room = 1 if max_tokens is None else max_tokens
    try:
        tokens = encode_prompt(
            tokenizer,
            prompt,
            vocab_size=vocab_size,
            name=param,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            max_num_tokens=None if max_model_len is None else max_model_len - room,
            truncate_prompt_tokens=truncate_prompt_tokens,
            chat=chat,
        )
    except PromptTooLong as exc:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has at least {exc.num_tokens} tokens (counted before it was tokenized "
            f"whole), leaving no room for {room} output tokens. Please shorten your prompt.",
            param=param,
            code="context_length_exceeded",
        ) from None
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param=param) from None
    if tokens.text is None:
        ids = tokens.token_ids
        if max_model_len is not None and len(ids) + room > max_model_len:
            return PromptTokens("", ids)  # `resolve_max_tokens` refuses it: never decoded
        return PromptTokens(tokenizer.decode(ids), ids)
    return tokens


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


def check_admissible(num_choices: int, max_unfinished: int, n: int) -> None:
    """APIError (400) when one request asks for more choices (n per prompt) than the server can
    ever hold at once: retrying it later (a 429) could never succeed."""
    if num_choices > max_unfinished:
        raise APIError(
            f"this request asks for {num_choices} choices (n={n} per prompt) but the server "
            f"never holds more than {max_unfinished} requests at once (--max-num-seqs plus "
            "--max-waiting-requests); lower n or send fewer prompts per request",
            param="n",
            code="too_many_choices",
        )


def check_response_size(
    n: int,
    max_tokens: list[int],
    prompt_tokens: list[int] | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> None:
    """APIError (400) when the response could carry more than MAX_RESPONSE_TOKENS token entries:
    per prompt, n × (max_tokens × (1 + logprobs) + returned prompt tokens × (1 +
    prompt_logprobs)). `prompt_tokens`: the prompt lengths when the prompt comes back (echo,
    prompt_logprobs), else None."""
    per_token = 1 + (logprobs or 0)
    per_prompt_token = 1 + (prompt_logprobs or 0)
    total = 0
    for i, m in enumerate(max_tokens):
        p = prompt_tokens[i] if prompt_tokens is not None else 0
        total += n * (m * per_token + p * per_prompt_token)
    if total > MAX_RESPONSE_TOKENS:
        raise APIError(
            f"this request could return {total} token entries (n={n} × {len(max_tokens)} "
            f"prompts × max_tokens × (1 + logprobs), echoed prompts included), more than the "
            f"{MAX_RESPONSE_TOKENS} one response may carry; lower n, max_tokens or logprobs, or "
            "send fewer prompts per request",
            param="n" if n > 1 else "max_tokens",
            code="response_too_large",
        )
