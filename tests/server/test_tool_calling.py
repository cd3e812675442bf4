"""Tool calling against a real `kvtier serve` process with the `openai` client: a tiny model whose
chat template is Hermes/Qwen-shaped (tools in a system block, calls as `<tool_call>` JSON, results
as `<tool_response>`), served with `--enable-auto-tool-choice --tool-call-parser hermes`. The
tools and a conversation's calls and results reach the template; `auto` answers with content when
the model calls nothing, whole or streamed; `required` and a named function return calls valid for
their tools (structured outputs), whole and streamed alike; the request checks are 400s naming
`tool_choice`."""

from __future__ import annotations

import http.client
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from kvtier.model.testing import write_tiny_model
from kvtier.server.tool_parsers import PARSERS
from kvtier.server.tools import ToolPlan, calls_schema
from tests.server.conftest import ServerHandle, free_port, serving

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Call functions as <tool_call>{"name": ..., "arguments": ...}</tool_call>.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{{ m.content or "" }}
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — now or forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
# a tool whose arguments are a finite language: a random model's constrained call always ends
UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAME = "tiny-hermes"


def hermes_model(folder: Path) -> Path:
    out = write_tiny_model(folder, "gemma3", window=8)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`kvtier serve` of the tiny Hermes-templated model with auto tool choice; its port."""
    folder = hermes_model(tmp_path_factory.mktemp("hermes"))
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvtier.cli", "serve", str(folder), "--port", str(port),
        "--served-model-name", NAME, "--max-model-len", "1024", "--num-device-blocks", "800",
        "--torch-threads", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with serving(cmd, port, folder / "serve.log"):
        yield port


def client(port: int) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    reply: dict[str, Any] = json.loads(conn.getresponse().read())
    conn.close()
    return reply


def rendered(port: int, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    """The prompt the chat template writes for `messages` (and `tools`), through /tokenize."""
    body: dict[str, Any] = {"model": NAME, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    ids = post(port, "/tokenize", body)["tokens"]
    text: str = post(port, "/detokenize", {"model": NAME, "tokens": ids})["prompt"]
    return text


def after_call(name: str, arguments: str, result: str) -> list[Any]:
    """QUESTION, the assistant's call `call_1` of `name` with `arguments` (JSON text), and the
    tool's `result`: a conversation that goes on after a tool ran."""
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def test_tools_reach_the_template_and_a_tool_result_continues(served: int) -> None:
    text = rendered(served, QUESTION, [WEATHER_TOOL])
    assert "<tools>" in text and json.dumps(WEATHER_TOOL, ensure_ascii=False) in text
    assert "<tools>" not in rendered(served, QUESTION, None)
    history = after_call("get_weather", '{"city": "Paris"}', '{"temp_c": 21}')
    text = rendered(served, history, [WEATHER_TOOL])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response id="call_1">\n{"temp_c": 21}\n</tool_response>' in text
    reply = client(served).chat.completions.create(
        model=NAME, messages=history, tools=[WEATHER_TOOL], max_completion_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(text.encode())  # bytes


def test_auto_answers_with_content_when_the_model_calls_nothing(served: int) -> None:
    c = client(served)
    whole = c.chat.completions.create(
        model=NAME, messages=QUESTION, tools=[WEATHER_TOOL], max_completion_tokens=24, temperature=0
    )
    message = whole.choices[0].message
    assert message.tool_calls is None and message.content
    assert "<tool_call>" not in message.content  # the random model wrote no call
    assert whole.choices[0].finish_reason == "length"
    chunks = list(
        c.chat.completions.create(
            model=NAME,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice="auto",
            max_completion_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == message.content
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"tool_choice": "auto"}, "tools"),  # a choice without tools
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "not among",
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
    ],
)
def test_tool_choices_the_request_cannot_have_are_400s(
    served: int, change: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(served).chat.completions.create(
            model=NAME, messages=QUESTION, max_completion_tokens=4, **change
        )
    assert bad.value.param == "tool_choice" and fragment in str(bad.value)


def test_bad_tool_names_are_400s_naming_the_field(served: int) -> None:
    tool = {"type": "function", "function": {"name": "get weather!"}}
    with pytest.raises(openai.BadRequestError) as bad:
        client(served).chat.completions.create(
            model=NAME,
            messages=QUESTION,
            tools=[tool],  # type: ignore[list-item]
        )
    assert bad.value.param == "tools.0.function.name"


def test_a_server_without_the_flags_refuses_auto_and_serves_none(server: ServerHandle) -> None:
    c = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(
            model="kvtier-default", messages=QUESTION, tools=[WEATHER_TOOL], max_completion_tokens=4
        )
    assert bad.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(bad.value)
    ok = c.chat.completions.create(
        model="kvtier-default",
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_completion_tokens=4,
    )
    assert ok.choices[0].message.tool_calls is None


def test_a_finished_output_with_calls_becomes_a_tool_calls_message() -> None:
    plan = ToolPlan([WEATHER_TOOL], PARSERS["hermes"]())
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Checking.<tool_call>\n{call}\n</tool_call>"
    message, reason = plan.message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Checking."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert plan.message(text, "length")[1] == "length"
    assert ToolPlan([WEATHER_TOOL]).message(text, "stop") == (
        {"role": "assistant", "content": text},
        "stop",
    )


def test_the_required_schema_holds_calls_to_the_tools_and_their_parameters() -> None:
    """tool_choice "required" enforces vLLM's shape: an array of {name, parameters}, each name
    one of the tools with that tool's parameters; parallel_tool_calls=false allows one call."""
    time_tool = {"type": "function", "function": {"name": "get_time"}}
    schema = calls_schema([WEATHER_TOOL, time_tool], None)
    jsonschema.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "get_time", "parameters": {}},
        ],
        schema,
    )
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "get_stock", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = calls_schema([WEATHER_TOOL], 1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "a"}}] * 2, one)


def _calls_whole_and_streamed(port: int, **kwargs: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calls of one request, whole and streamed (deltas reassembled per index): the two must
    be the same calls; returned as (name, parsed arguments)."""
    c = client(port)
    common = {"model": NAME, "messages": QUESTION, "max_completion_tokens": 256, "temperature": 0}
    whole = c.chat.completions.create(**common, **kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert all(t.id and t.type == "function" for t in choice.message.tool_calls)
    parts: dict[int, dict[str, str]] = {}
    last = None
    for chunk in c.chat.completions.create(**common, **kwargs, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            got = parts.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function and d.function.name:
                got["name"] += d.function.name
            if d.function and d.function.arguments:
                got["arguments"] += d.function.arguments
        last = chunk.choices[0].finish_reason or last
    assert last == "tool_calls"
    streamed = [(v["name"], json.loads(v["arguments"])) for _, v in sorted(parts.items())]
    assert streamed == calls
    return calls


def test_required_returns_calls_valid_for_their_tools_whole_and_streamed(served: int) -> None:
    tools = [UNIT_TOOL, {"type": "function", "function": {"name": "get_time"}}]
    calls = _calls_whole_and_streamed(
        served, tools=tools, tool_choice="required", parallel_tool_calls=False
    )
    assert len(calls) == 1
    (name, args) = calls[0]
    (tool,) = [t for t in tools if t["function"]["name"] == name]
    jsonschema.validate(args, tool["function"].get("parameters", {"type": "object"}))


def test_a_named_function_is_called_with_valid_arguments_and_the_chat_continues(
    served: int,
) -> None:
    named = {"type": "function", "function": {"name": "set_unit"}}
    calls = _calls_whole_and_streamed(served, tools=[WEATHER_TOOL, UNIT_TOOL], tool_choice=named)
    assert [name for name, _ in calls] == ["set_unit"]
    jsonschema.validate(calls[0][1], UNIT_TOOL["function"]["parameters"])  # type: ignore[index]
    history = after_call("set_unit", json.dumps(calls[0][1]), "ok")
    reply = client(served).chat.completions.create(
        model=NAME, messages=history, tools=[UNIT_TOOL], max_completion_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
