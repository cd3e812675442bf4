"""Prompts → token ids on the HTTP side: `engine/prompts.py` `encode_prompt` (the one front end,
shared with the offline `LLM`) with its errors as 400s naming `prompt` or `messages`, and the
context-length check. Called in a worker thread (`asyncio.to_thread`), so the engine thread only
ever receives token ids; the tokenizer releases the GIL while it encodes."""

from __future__ import annotations

from kvtier.engine.prompts import Prompt, PromptTokens, encode_prompt
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.protocol import APIError

__all__ = ["Prompt", "PromptTokens", "encode", "resolve_max_tokens"]


def encode(
    tokenizer: Tokenizer,
    prompt: Prompt,
    vocab_size: int,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
) -> PromptTokens:
    """Token ids of one prompt and its text (token ids are decoded for echo); APIError (400) for
    what `encode_prompt` refuses (empty prompts, ids outside the vocabulary, template errors)."""
    is_chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    param = "messages" if is_chat else "prompt"
    try:
        tokens = encode_prompt(
            tokenizer,
            prompt,
            vocab_size=vocab_size,
            name=param,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
        )
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), param=param) from None
    if tokens.text is None:
        return PromptTokens(tokenizer.decode(tokens.token_ids), tokens.token_ids)
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
