"""Tool calls in a model's text, one parser per chat-template family under vLLM's
`--tool-call-parser` names: `hermes` (Hermes 2 Pro, Qwen2.5/Qwen3:
`<tool_call>{json}</tool_call>`), `llama3_json` (Llama 3.1–3.3: `{"name": …, "parameters": …}`,
optionally after `<|python_tag|>`, several separated by `;`) and `mistral`
(`[TOOL_CALLS][{"name": …, "arguments": …}, …]`); and the held outputs of tool_choice "required"
and of a named function.

A parser splits a text — whole, or the prefix streamed so far — into the content before the calls
and the calls, each with the part of its JSON known so far. Partial JSON is read with
`partial-json-parser` (strings, numbers and literals only once complete), so a prefix never
reports a value that more text could change. `ToolCallStream` turns successive prefixes into
OpenAI's streamed deltas. Knows no request, model or engine.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

import partial_json_parser
from partial_json_parser.core.exceptions import MalformedJSON
from partial_json_parser.core.options import Allow

# containers may be open; strings, numbers and true/false/null only once complete
_PARTIAL = Allow.OBJ | Allow.ARR
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class RawCall:
    """One call as far as the text goes: `name` once complete, `arguments` (the object so far,
    None before it starts) and whether the call's JSON is complete."""

    name: str | None
    arguments: dict[str, Any] | None
    complete: bool


@dataclass(slots=True)
class Split:
    content: str  # text before the calls (held-back text excluded while streaming)
    calls: list[RawCall]


class ToolParser(abc.ABC):
    """Base: a family's markers and how its call objects name their arguments."""

    name = ""
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    @abc.abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """`text` split into content and calls. Not `final`: a prefix of the output, so text
        that may still become a marker is held back. `final`: the whole output; a call whose
        JSON is malformed makes the whole text content (as vLLM answers)."""

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        """Whether the detokenizer may skip special tokens (a family whose marker is one keeps
        them)."""
        return skip

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _call(self, obj: object, complete: bool) -> RawCall | None:
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = next((obj[k] for k in self.argument_keys if k in obj), None)
        if isinstance(args, str) and complete:  # some models send the arguments as a string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if args is not None and not isinstance(args, dict):
            return (
                None if complete else RawCall(name if isinstance(name, str) else None, None, False)
            )
        if complete and not isinstance(name, str):
            return None
        return RawCall(name if isinstance(name, str) else None, args, complete)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _partial(text: str) -> Any:
    try:
        return partial_json_parser.loads(text, _PARTIAL)
    except (MalformedJSON, ValueError, IndexError):
        return None


def _objects(text: str, separators: str) -> tuple[list[Any], str]:
    """The complete JSON values at the start of `text` (whitespace and `separators` between
    them) and the rest, which does not start with a complete value."""
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append(value)
        pos = end


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> Split:
        at = text.find(self.start)
        if at < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.start)
            return Split(text[:keep], [])
        calls: list[RawCall] = []
        for segment in text[at + len(self.start) :].split(self.start):
            closed = self.end in segment
            body = segment.split(self.end, 1)[0].strip()
            if final or closed:
                try:
                    call = self._call(json.loads(body), True)
                except json.JSONDecodeError:
                    call = None
                if call is None:
                    if final:
                        return Split(text, [])
                    continue
            else:
                call = self._call(_partial(body), False)
                if call is None:
                    continue
            calls.append(call)
        return Split(text[:at], calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :]
        elif not body.startswith("{"):
            if not final and (not body or self.tag.startswith(body)):
                return Split("", [])  # may still become a call
            return Split(text, [])
        values, rest = _objects(body, ";")
        calls = [self._call(v, True) for v in values]
        if final:
            if rest.strip() or not values or any(c is None for c in calls):
                return Split(text, [])
            return Split("", [c for c in calls if c is not None])
        out = [c for c in calls if c is not None]
        if rest:
            last = self._call(_partial(rest), False)
            if last is not None:
                out.append(last)
        return Split("", out)


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False  # [TOOL_CALLS] is a special token of Mistral's tokenizers

    def new_call_id(self) -> str:
        # Mistral's templates accept only ids of 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def split(self, text: str, final: bool) -> Split:
        at = text.find(self.marker)
        if at < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.marker)
            return Split(text[:keep], [])
        body = text[at + len(self.marker) :].strip()
        if final:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return Split(text, [])
            items = value if isinstance(value, list) else [value]
            calls = [self._call(v, True) for v in items]
            if not calls or any(c is None for c in calls):
                return Split(text, [])
            return Split(text[:at], [c for c in calls if c is not None])
        parsed = _partial(body)
        items = parsed if isinstance(parsed, list) else [] if parsed is None else [parsed]
        closed = _is_complete(body)
        out: list[RawCall] = []
        for i, item in enumerate(items):
            done = closed or i < len(items) - 1
            call = self._call(item, done)
            if call is not None:
                out.append(call)
        return Split(text[:at], out)


class RequiredCallsParser(ToolParser):
    """tool_choice "required": the output is held to a JSON array of {"name", "parameters"}
    objects (`tools.py` `calls_schema`), so the whole text is the calls."""

    name = "required"
    argument_keys = ("parameters",)

    def split(self, text: str, final: bool) -> Split:
        body = text.strip()
        if final:
            try:
                items = json.loads(body)
            except json.JSONDecodeError:
                return Split(text, [])
            calls = [self._call(v, True) for v in items] if isinstance(items, list) else []
            if not calls or any(c is None for c in calls):
                return Split(text, [])
            return Split("", [c for c in calls if c is not None])
        parsed = _partial(body)
        items = parsed if isinstance(parsed, list) else []
        closed = _is_complete(body)
        out = [self._call(v, closed or i < len(items) - 1) for i, v in enumerate(items)]
        return Split("", [c for c in out if c is not None])


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the output is held to that function's arguments object,
    so the whole text is one call's arguments."""

    def __init__(self, function: str) -> None:
        self.function = function

    def split(self, text: str, final: bool) -> Split:
        body = text.strip()
        if final:
            try:
                args = json.loads(body)
            except json.JSONDecodeError:
                return Split(text, [])
            ok = isinstance(args, dict)
            return Split("", [RawCall(self.function, args, True)]) if ok else Split(text, [])
        args = _partial(body)
        return Split("", [RawCall(self.function, args if isinstance(args, dict) else None, False)])


def _is_complete(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def arguments_json(arguments: dict[str, Any] | None) -> str:
    """The arguments as the `arguments` string of a tool call (one spelling, whole or streamed)."""
    return json.dumps(arguments or {}, ensure_ascii=False)


def _stable_prefix(arguments: dict[str, Any]) -> str:
    """The part of `arguments_json` that no later text can change: without the closing brackets
    of the containers still open (complete values end in a quote, digit or letter)."""
    return re.sub(r"[\]}]+$", "", arguments_json(arguments))


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: str = ""  # the argument text sent so far


@dataclass
class ToolCallStream:
    """One choice's streamed output → OpenAI deltas: content as it becomes safe to show, then
    per call a first delta with its id, type and name, then fragments of its arguments whose
    concatenation is the whole `arguments` string. `feed` takes the text so far."""

    parser: ToolParser
    max_calls: int | None = None  # parallel_tool_calls=false: only the first call
    content_sent: int = 0
    sent: list[_Sent] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool call deltas) for the output `text` so far; each delta is one
        chunk's `tool_calls` entry, as OpenAI sends them (a call's id and name, then fragments of
        its arguments)."""
        split = self.parser.split(text, final)
        content = (
            split.content[self.content_sent :] if len(split.content) > self.content_sent else ""
        )
        self.content_sent = max(self.content_sent, len(split.content))
        deltas: list[dict[str, Any]] = []
        calls = split.calls if self.max_calls is None else split.calls[: self.max_calls]
        for i, call in enumerate(calls):
            if i == len(self.sent):
                if call.name is None:
                    break
                self.sent.append(_Sent(self.parser.new_call_id(), call.name))
                first = {"name": call.name, "arguments": ""}
                deltas.append({"index": i, "id": self.sent[i].id, "type": "function"})
                deltas[-1]["function"] = first
            if call.arguments is None and not call.complete:
                continue
            target = (
                arguments_json(call.arguments)
                if call.complete
                else _stable_prefix(call.arguments or {})
            )
            done = self.sent[i].arguments
            if len(target) > len(done) and target.startswith(done):
                piece = target[len(done) :]
                self.sent[i].arguments = target
                deltas.append({"index": i, "function": {"arguments": piece}})
        return content, deltas

    @property
    def num_calls(self) -> int:
        return len(self.sent)


def parse_tool_calls(
    parser: ToolParser, text: str, max_calls: int | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output → (content or None, OpenAI `tool_calls` entries)."""
    split = parser.split(text, final=True)
    calls = split.calls if max_calls is None else split.calls[:max_calls]
    entries = [
        {
            "id": parser.new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": arguments_json(c.arguments)},
        }
        for c in calls
    ]
    content = split.content if split.content.strip() or not entries else None
    return content, entries
