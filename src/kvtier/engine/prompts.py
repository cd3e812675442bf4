"""Prompts → token ids, the one front end of the offline `LLM` and the server: text, token ids,
chat messages (through the tokenizer's chat template, or a plain `role: text` one), and the
offline API's dicts ({"prompt": text} or {"prompt_token_ids": ids, "prompt": optional text}).

Errors are TypeError / ValueError naming the prompt as the caller calls it (`name`); the server
turns them into 400s. Safe from any thread (the tokenizer is): the server encodes off the engine
thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.checks import check_ints, show, show_ids

if TYPE_CHECKING:
    from kvtier.model.tokenizer import Tokenizer

Prompt = str | list[int] | list[dict[str, Any]] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    text: str | None  # the prompt as text (None: token ids given without text)
    token_ids: list[int]


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: Prompt,
    *,
    vocab_size: int,
    name: str = "prompt",
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
) -> PromptTokens:
    """Token ids of one prompt, checked: non-empty, inside the vocabulary [0, `vocab_size`).

    `add_special_tokens=None`: text gets them, a chat template writes its own (the plain
    template gets the tokenizer's)."""
    if isinstance(prompt, str):
        special = True if add_special_tokens is None else add_special_tokens
        return PromptTokens(prompt, _encode(tokenizer, prompt, name, special))
    if isinstance(prompt, dict):
        return _encode_dict(tokenizer, prompt, vocab_size, name)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        messages: list[dict[str, Any]] = prompt
        text = render_chat(tokenizer, messages, add_generation_prompt)
        special = not tokenizer.chat_template if add_special_tokens is None else add_special_tokens
        return PromptTokens(text, _encode(tokenizer, text, name, special))
    if isinstance(prompt, list):
        return PromptTokens(None, check_prompt_ids(prompt, vocab_size, name))
    raise TypeError(
        f"{name} must be text, token ids, chat messages or a dict with 'prompt' or "
        f"'prompt_token_ids', got {show(prompt)}"
    )


def check_prompt_ids(
    token_ids: object, vocab_size: int, name: str = "prompt_token_ids"
) -> list[int]:
    """`token_ids` as a list of ints; TypeError / ValueError naming `name` when they are not ints,
    empty, or outside the vocabulary [0, `vocab_size`)."""
    tokens = list(check_ints(name, token_ids, lo=None))
    if not tokens:
        raise ValueError(f"{name} is empty; send at least one token")
    if min(tokens) >= 0 and max(tokens) < vocab_size:
        return tokens
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{name} {show_ids(bad)} are outside the vocabulary [0, {vocab_size}); "
            "tokenize with this model's tokenizer"
        )
    return tokens


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_gen: bool) -> str:
    """The tokenizer's chat template, or the plain `role: text` one; ValueError on template
    errors (they are the messages' fault)."""
    try:
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(messages, add_gen)
        return render_default_chat(messages, add_gen)
    except Exception as exc:
        raise ValueError(f"chat template: {exc}") from None


def render_default_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The plain template, used when the tokenizer has none: one `role: content` line per
    message, then `assistant:` when a generation prompt is wanted."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


def _encode_dict(
    tokenizer: Tokenizer, prompt: dict[str, Any], vocab_size: int, name: str
) -> PromptTokens:
    if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"{name}['prompt'] must be a string, got {show(text)}")
        ids = check_prompt_ids(
            prompt["prompt_token_ids"], vocab_size, f"{name}['prompt_token_ids']"
        )
        return PromptTokens(text, ids)
    if isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
        return PromptTokens(text, _encode(tokenizer, text, f"{name}['prompt']", True))
    raise TypeError(
        f"{name} must be a string or a dict with 'prompt' (a string) or 'prompt_token_ids', "
        f"got {show(prompt)}"
    )


def _encode(tokenizer: Tokenizer, text: str, name: str, add_special_tokens: bool) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode: a lone surrogate at character {exc.start}; "
            "pair or drop it"
        ) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
