"""Prompts → token ids, the one front end of the offline `LLM` and the server: text, token ids,
chat messages (through the tokenizer's chat template, or a plain `role: text` one), and the
offline API's dicts ({"prompt": text} or {"prompt_token_ids": ids, "prompt": optional text}).

Errors are TypeError / ValueError naming the prompt as the caller calls it (`name`); the server
turns them into 400s. Safe from any thread (the tokenizer is): the server encodes off the engine
thread. A text longer than `max_num_tokens` is found by counting it in chunks, with an early stop,
before it is tokenized whole: one huge prompt never costs more than its allowed length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.checks import check_ints, show, show_ids

if TYPE_CHECKING:
    from kvtier.model.tokenizer import Tokenizer

Prompt = str | list[int] | list[dict[str, Any]] | dict[str, Any]


# Chunks of a long text counted apart when its length is checked: each is tokenized on its own,
# so the memory of the check is that of one chunk, whatever the text's length.
CHUNK_CHARS = 1 << 14


@dataclass(frozen=True, slots=True)
class PromptTokens:
    text: str | None  # the prompt as text (None: token ids given without text)
    token_ids: list[int]


class PromptTooLong(ValueError):
    """A text prompt found to hold more than `limit` tokens before it was tokenized whole;
    `num_tokens` is a lower bound of its length."""

    def __init__(self, name: str, num_tokens: int, limit: int) -> None:
        super().__init__(
            f"{name} has at least {num_tokens} tokens, more than the {limit} allowed; shorten it"
        )
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How chat messages become the prompt's text (vLLM's names): the generation prompt, or the
    final message left open for the model to continue; extra variables for the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool entries, for the template


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: Prompt,
    *,
    vocab_size: int,
    name: str = "prompt",
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
    max_num_tokens: int | None = None,
    truncate_prompt_tokens: int | None = None,
    chat: ChatOptions | None = None,
) -> PromptTokens:
    """Token ids of one prompt, checked: non-empty, inside the vocabulary [0, `vocab_size`).

    `add_special_tokens=None`: text gets them, a chat template writes its own (the plain
    template gets the tokenizer's). `max_num_tokens`: PromptTooLong for a text found longer
    before it is tokenized whole (the caller checks the exact count). `truncate_prompt_tokens`:
    only the prompt's last that many tokens (vLLM's left truncation), a long text's tail alone
    tokenized, and the text left out (it is not the prompt's any more)."""
    limit = None if truncate_prompt_tokens is not None else max_num_tokens
    if isinstance(prompt, str):
        special = True if add_special_tokens is None else add_special_tokens
        ids = _encode(tokenizer, prompt, name, special, limit, truncate_prompt_tokens)
        return PromptTokens(prompt if truncate_prompt_tokens is None else None, ids)
    if isinstance(prompt, dict):
        return _encode_dict(tokenizer, prompt, vocab_size, name)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        messages: list[dict[str, Any]] = prompt
        opts = chat or ChatOptions(add_generation_prompt)
        text = render_chat(tokenizer, messages, opts)
        special = not tokenizer.chat_template if add_special_tokens is None else add_special_tokens
        ids = _encode(tokenizer, text, name, special, limit, truncate_prompt_tokens)
        return PromptTokens(text if truncate_prompt_tokens is None else None, ids)
    if isinstance(prompt, list):
        ids = check_prompt_ids(prompt, vocab_size, name)
        return PromptTokens(
            None, ids if truncate_prompt_tokens is None else ids[-truncate_prompt_tokens:]
        )
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


def render_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], chat: ChatOptions | bool = True
) -> str:
    """The tokenizer's chat template, or the plain `role: text` one; ValueError on template
    errors (they are the messages' fault). With `continue_final_message` the text ends where
    the final message's content ends, as `transformers` cuts it."""
    opts = chat if isinstance(chat, ChatOptions) else ChatOptions(chat)
    add_gen = opts.add_generation_prompt and not opts.continue_final_message
    try:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                messages, add_gen, opts.template_kwargs, opts.tools
            )
        else:
            text = render_default_chat(messages, add_gen, opts.tools)
    except Exception as exc:
        raise ValueError(f"chat template: {exc}") from None
    return _open_final_message(text, messages) if opts.continue_final_message else text


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` cut right after the last occurrence of the final message's content (its trailing
    whitespace kept when the template kept it), so the model continues that message."""
    final = messages[-1].get("content") or ""
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ValueError(
            "continue_final_message: the final message's content does not appear in the "
            "rendered chat; end the messages with the (non-empty) text to continue"
        )
    at = text.rindex(final.strip())
    kept = final.lstrip()
    end = at + (len(kept) if text[at : at + len(kept)] == kept else len(final.strip()))
    return text[:end]


def render_default_chat(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The plain template, used when the tokenizer has none: a `tools:` line with their JSON
    when given, one `role: content` line per message (an assistant's tool calls as JSON after
    its content), then `assistant:` when a generation prompt is wanted."""
    text = f"tools: {json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
    for m in messages:
        calls = m.get("tool_calls")
        extra = f" {json.dumps(calls, ensure_ascii=False)}" if calls else ""
        text += f"{m['role']}: {m['content']}{extra}\n"
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


def _encode(
    tokenizer: Tokenizer,
    text: str,
    name: str,
    add_special_tokens: bool,
    max_num_tokens: int | None = None,
    truncate: int | None = None,
) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode: a lone surrogate at character {exc.start}; "
            "pair or drop it"
        ) from None
    if truncate is not None:
        return _encode_tail(tokenizer, text, add_special_tokens, truncate)
    if max_num_tokens is not None and len(text) > CHUNK_CHARS:
        _check_length(tokenizer, text, name, add_special_tokens, max_num_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


_WORD_END = re.compile(r"(?<=\S)\s")


def _cuts(text: str, start: int) -> int:
    """The first whitespace run's start at or after `start` (where every common pre-tokenizer
    splits), or `start` when none is near."""
    if start >= len(text):
        return len(text)
    found = _WORD_END.search(text, max(start, 1), start + CHUNK_CHARS)
    return found.start() if found else start


def _check_length(
    tokenizer: Tokenizer, text: str, name: str, add_special_tokens: bool, limit: int
) -> None:
    """PromptTooLong once `text`, counted chunk by chunk, is sure to exceed `limit` tokens.
    A cut at a word start rarely changes the count; one token per cut is allowed for it."""
    count = len(tokenizer.encode("", add_special_tokens=add_special_tokens))
    pos, num_cuts = 0, 0
    while pos < len(text):
        end = _cuts(text, pos + CHUNK_CHARS)
        count += len(tokenizer.encode(text[pos:end], add_special_tokens=False))
        if count - num_cuts > limit:
            raise PromptTooLong(name, count - num_cuts, limit)
        pos, num_cuts = end, num_cuts + 1


def _encode_tail(tokenizer: Tokenizer, text: str, add_special_tokens: bool, k: int) -> list[int]:
    """The last `k` token ids of `text`: its tail alone tokenized, grown until it holds well
    over `k` tokens (so the cut's effect on the first few is dropped), or the whole text."""
    size = CHUNK_CHARS
    while size < len(text):
        tail = text[_cuts(text, len(text) - size) :]
        ids = tokenizer.encode(tail, add_special_tokens=add_special_tokens)
        if len(ids) > k + 8:
            return ids[-k:]
        size *= 2
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)[-k:]


def bad_words_token_ids(
    tokenizer: Tokenizer, words: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, as vLLM tokenizes them: the word alone (at the start of a
    text), and after a space when that spelling starts with another token but has as many (a
    word inside a text); ValueError naming `bad_words` for a word with no tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise ValueError(f"bad_words entry {show(word)} has no tokens; drop it")
        out.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            out.append(spaced)
    return tuple(out)
