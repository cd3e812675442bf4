"""Structured outputs over HTTP: OpenAI's `response_format` (json_object, json_schema strict or
not), vLLM's `structured_outputs` and its older `guided_*` fields, on completions and chat,
streamed and whole; a spec the engine cannot compile is a 400 naming the problem; the official
`openai` client's `beta.chat.completions.parse` with a Pydantic model against `kvtier serve`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, ServerHandle, free_port, serve_command, serving

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
LARK = 'start: "x" yz yz? yz? "!"\nyz: "y" | "z"'
GBNF = 'root ::= "x" yz yz? yz? "!"\nyz ::= "y" | "z"'  # vLLM's EBNF, converted to Lark
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "A person as JSON:"}]}
COMPLETION = {"model": MODEL, "prompt": "A person as JSON:"}


def _chat_text(server: ServerHandle, body: dict[str, Any]) -> tuple[str, str]:
    status, payload = server.post("/v1/chat/completions", CHAT | {"max_tokens": 120} | body)
    assert status == 200, payload
    choice = payload["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def _completion_text(server: ServerHandle, body: dict[str, Any]) -> tuple[str, str]:
    status, payload = server.post("/v1/completions", COMPLETION | {"max_tokens": 120} | body)
    assert status == 200, payload
    choice = payload["choices"][0]
    return choice["text"], choice["finish_reason"]


@pytest.mark.parametrize("strict", [True, False, None])
def test_chat_json_schema_validates_streamed_and_whole(server: ServerHandle, strict: Any) -> None:
    fmt: dict[str, Any] = {"name": "person", "schema": SCHEMA}
    if strict is not None:
        fmt["strict"] = strict
    body = {"response_format": {"type": "json_schema", "json_schema": fmt}, "temperature": 0.0}
    text, reason = _chat_text(server, body)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = server.client().chat.completions.create(
        messages=CHAT["messages"], model=MODEL, max_tokens=120, stream=True, **body
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_json_object_gives_an_object(server: ServerHandle) -> None:
    text, reason = _chat_text(server, {"response_format": {"type": "json_object"}, "seed": 1})
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an object's strings are unbounded; it was cut inside one
        assert text.startswith("{") and reason == "length"


def test_text_response_format_leaves_the_output_free(server: ServerHandle) -> None:
    free, _ = _chat_text(server, {"temperature": 0.0, "max_tokens": 8})
    text, _ = _chat_text(
        server, {"temperature": 0.0, "max_tokens": 8, "response_format": {"type": "text"}}
    )
    assert text == free


@pytest.mark.parametrize(
    ("field", "check"),
    [
        ({"structured_outputs": {"json": SCHEMA}}, "schema"),
        ({"guided_json": SCHEMA}, "schema"),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
        ({"structured_outputs": {"choice": ["cat", "dog", "eel"]}}, "cat|dog|eel"),
        ({"guided_choice": ["cat", "dog", "eel"]}, "cat|dog|eel"),
        ({"structured_outputs": {"grammar": LARK}}, "x[yz]{1,3}!"),
        ({"guided_grammar": GBNF}, "x[yz]{1,3}!"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_follow_structured_outputs(
    server: ServerHandle, field: dict[str, Any], check: str, stream: bool
) -> None:
    body = field | {"seed": 3, "temperature": 1.0}
    text, reason = _completion_text(server, body)
    assert reason == "stop", text
    if check == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(check, text), text
    if stream:
        chunks = server.client().completions.create(
            model=MODEL,
            prompt=COMPLETION["prompt"],
            max_tokens=120,
            stream=True,
            seed=3,
            temperature=1.0,
            extra_body=field,
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_n_choices_are_each_valid(server: ServerHandle) -> None:
    body = {"n": 3, "seed": 5, "temperature": 1.0, "structured_outputs": {"json": SCHEMA}}
    status, payload = server.post("/v1/chat/completions", CHAT | {"max_tokens": 120} | body)
    assert status == 200, payload
    for choice in payload["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "does not compile"),
        ({"structured_outputs": {"json": '{"type": '}}, "not valid JSON"),
        ({"guided_regex": "a(b"}, "regex"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "grammar"),
        ({"guided_json": {"enum": ["x" * 70_000]}}, "--structured-outputs-max-spec-bytes"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "send only one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "send only one"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"choice": []}}, "at least one"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens"),
        ({"structured_outputs": {"regex": "a+", "whitespace_pattern": "x"}}, "whitespace"),
    ],
)
def test_bad_specs_are_400_naming_the_problem(
    server: ServerHandle, body: dict[str, Any], words: str
) -> None:
    status, payload = server.post("/v1/chat/completions", CHAT | {"max_tokens": 4} | body)
    assert status == 400, payload
    assert words in payload["error"]["message"], payload
    assert server.engine.call(lambda e: e.stats().num_requests) == 0


class Pet(BaseModel):
    kind: Literal["cat", "dog", "eel"]
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=30)]
    friendly: bool


def test_openai_parse_with_a_pydantic_model_against_kvtier_serve(tmp_path: Path) -> None:
    port = free_port()
    with serving(serve_command(port, 512, 256), port, tmp_path / "serve.log", 300):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        for seed in range(3):
            done = client.beta.chat.completions.parse(
                model=MODEL,
                messages=[{"role": "user", "content": "Describe a pet."}],
                response_format=Pet,
                max_tokens=120,
                seed=seed,
            )
            pet = done.choices[0].message.parsed
            assert isinstance(pet, Pet), done
            assert done.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"guided_regex": "a(b"},
            )
        assert "regex" in str(bad.value)
