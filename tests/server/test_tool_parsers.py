"""The tool-call parsers on realistic outputs of each family: whole texts give the content and the
calls; streamed with chunk boundaries anywhere (every single split point, and random chunkings),
the deltas come in OpenAI's order (id and name, then argument fragments) and reassemble to the
same content and calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvtier.server.tool_parsers import (
    PARSERS,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallStream,
    ToolParser,
    parse_tool_calls,
)

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "detail": {"wind": True}}
TIME = {"timezone": "Europe/Berlin", "note": 'braces } and ] and "quotes" — ünïcode'}

# (parser, output, content, [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (
        "hermes",  # Qwen2.5: content, then calls on their own lines
        "Let me check both.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": TIME}, ensure_ascii=False)
        + "\n</tool_call>",
        "Let me check both.\n",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "hermes",  # unterminated at the end of the output (stopped on EOS)
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        None,
        [("get_time", {})],
    ),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", None, []),
    (
        "llama3_json",  # Llama 3.1: a bare JSON object, "parameters"
        json.dumps({"name": "get_weather", "parameters": WEATHER}),
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",  # python tag and two calls separated by ";"
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "get_time", "parameters": TIME}, ensure_ascii=False),
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", "The weather in Paris is mild.", None, []),
    ("llama3_json", '{"answer": 42} is not a call', None, []),
    (
        "mistral",
        "Sure.[TOOL_CALLS]"
        + json.dumps(
            [
                {"name": "get_weather", "arguments": WEATHER},
                {"name": "get_time", "arguments": TIME},
            ],
            ensure_ascii=False,
        ),
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("mistral", "Nothing to call [TOOL", None, []),
    (
        "required",  # tool_choice "required": the output held to vLLM's array of calls
        json.dumps(
            [
                {"name": "get_weather", "parameters": WEATHER},
                {"name": "get_time", "parameters": TIME},
            ],
            ensure_ascii=False,
        ),
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("named", json.dumps(WEATHER), None, [("get_weather", WEATHER)]),  # a named function
]


def make(parser: str) -> ToolParser:
    if parser == "required":
        return RequiredCallsParser()
    if parser == "named":
        return NamedCallParser("get_weather")
    return PARSERS[parser]()


def expected_content(text: str, content: str | None, calls: list[Any]) -> str | None:
    if not calls:
        return text
    return content


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_output_gives_its_content_and_calls(
    parser: str, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse_tool_calls(make(parser), text)
    assert got_content == expected_content(text, content, calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"] for c in got)
    assert len({c["id"] for c in got}) == len(got)


def reassemble(parser: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed the prefixes of `chunks`; returns the streamed content, the calls as (name,
    arguments string) and the order of the delta kinds per call ("head", "args")."""
    stream = ToolCallStream(make(parser))
    text, content = "", ""
    calls: dict[int, dict[str, Any]] = {}
    order: list[str] = []
    for i, chunk in enumerate(chunks):
        text += chunk
        piece, deltas = stream.feed(text, final=i == len(chunks) - 1)
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls), "calls open in order"
                assert d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
                order.append(f"head{d['index']}")
            else:
                assert d["index"] in calls, "arguments only after the call's name"
                calls[d["index"]]["args"] += d["function"]["arguments"]
                order.append(f"args{d['index']}")
    return content, [(c["name"], c["args"]) for c in calls.values()], order


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_deltas_reassemble_to_the_whole_result_split_anywhere(
    parser: str, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    whole_content, whole = parse_tool_calls(make(parser), text)
    want_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    want_content = whole_content or ""
    chunkings = [[text[:k], text[k:]] for k in range(1, len(text))]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    chunkings.append(list(text))  # one character at a time
    for chunks in chunkings:
        got_content, got_calls, order = reassemble(parser, chunks)
        assert got_content == want_content, chunks
        assert got_calls == want_calls, chunks
        for i in range(len(want_calls)):
            assert order.index(f"head{i}") < min(
                (j for j, o in enumerate(order) if o == f"args{i}"), default=len(order)
            )


def test_arguments_stream_before_the_call_ends() -> None:
    """Fragments are sent while the model still writes the call (not all at the end)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    stream = ToolCallStream(PARSERS["hermes"]())
    seen = []
    for k in range(1, len(text) + 1):
        seen += stream.feed(text[:k])[1]
    fragments = [d["function"]["arguments"] for d in seen if "id" not in d]
    assert len(fragments) >= 2 and "".join(fragments).startswith('{"city": "Paris"')


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = CASES[0][1]
    _, calls = parse_tool_calls(PARSERS["hermes"](), text, max_calls=1)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    stream = ToolCallStream(PARSERS["hermes"](), max_calls=1)
    _, deltas = stream.feed(text, final=True)
    assert {d["index"] for d in deltas} == {0}


def test_mistral_ids_are_nine_letters_and_digits_and_keep_special_tokens() -> None:
    parser = PARSERS["mistral"]()
    _, calls = parse_tool_calls(parser, CASES[7][1])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert parser.adjust_skip_special_tokens(True) is False
    assert PARSERS["hermes"]().adjust_skip_special_tokens(True) is True
