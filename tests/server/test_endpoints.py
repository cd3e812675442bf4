"""vLLM's extra endpoints and parameters: /tokenize, /detokenize, /version, /v1/models/{id},
`n` choices per prompt (seeded children differ as vLLM's do: seed + index), and
`stream_options` only with `stream` (a 400 otherwise, as vLLM and OpenAI)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import openai
import pytest

import kvtier
from tests.server.conftest import MODEL, ServerHandle


def _get(server: ServerHandle, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_tokenize_and_detokenize_as_vllm(server: ServerHandle) -> None:
    tok = server.engine.call(lambda e: e.tokenizer)
    ids = tok.encode("The with statement")
    status, out = server.post("/tokenize", {"model": MODEL, "prompt": "The with statement"})
    assert status == 200, out
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    status, out = server.post(
        "/tokenize",
        {"prompt": "The with statement", "add_special_tokens": False, "return_token_strs": True},
    )
    assert out["tokens"] == ids[1:] and out["token_strs"] == ["The", "Ġwith", "Ġstatement"]
    status, out = server.post("/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and out == {"prompt": "<bos>The with statement"}  # specials kept

    messages = [{"role": "user", "content": "Hi there"}]
    status, out = server.post("/tokenize", {"messages": messages})
    assert status == 200, out
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None and out["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("/detokenize", {"tokens": [5, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [5]}, 404, "model"),
    ],
)
def test_tokenize_errors(
    server: ServerHandle, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    got, out = server.post(path, body)
    assert got == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["param"] == param


def test_version_and_model_card(server: ServerHandle) -> None:
    assert _get(server, "/version") == (200, {"version": kvtier.__version__})
    card = server.client().models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "kvtier" and card.created > 0
    extra = card.model_extra or {}
    assert set(extra) == {"max_model_len", "root", "parent", "permission"}
    assert extra["max_model_len"] == 512 and extra["parent"] is None
    # vLLM's `vllm bench serve` loads its tokenizer from `root` when it has no --model
    assert (Path(extra["root"]) / "tokenizer.json").is_file()
    (perm,) = extra["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
    with pytest.raises(openai.NotFoundError) as exc:
        server.client().models.retrieve("gpt-4o")
    assert exc.value.code == "model_not_found"


def test_n_choices_per_prompt_are_seeded_children(server: ServerHandle) -> None:
    client = server.client()
    prompts = ["The for statement", "The while statement"]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    out = client.completions.create(prompt=prompts, n=3, echo=True, **kw)
    assert [c.index for c in out.choices] == list(range(6))  # prompt_index * n + i
    for c in out.choices:
        assert c.text.startswith(prompts[c.index // 3])
    # child i samples with seed + i, as vLLM's parallel sampling does
    for i in range(3):
        alone = client.completions.create(prompt=prompts[1], **kw | {"seed": 7 + i})
        assert out.choices[3 + i].text == prompts[1] + alone.choices[0].text
    assert len({c.text for c in out.choices[3:]}) == 3  # the children differ
    assert out.usage is not None and out.usage.completion_tokens == 6 * 8
    lens = [len(server.engine.call(lambda e, p=p: e.tokenizer.encode(p))) for p in prompts]
    assert out.usage.prompt_tokens == sum(lens)  # each prompt counted once, as vLLM
    again = client.completions.create(prompt=prompts, n=3, echo=True, **kw)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]

    streamed = ["" for _ in range(6)]
    for chunk in client.completions.create(prompt=prompts, n=3, echo=True, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in out.choices]


def test_chat_n_choices(server: ServerHandle) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    messages: Any = [{"role": "user", "content": "Tell me about loops"}]
    out = client.chat.completions.create(messages=messages, n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1]
    second = client.chat.completions.create(messages=messages, **kw | {"seed": 4})
    assert out.choices[1].message.content == second.choices[0].message.content
    texts = ["", ""]
    roles: list[int] = []
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role == "assistant":
                roles.append(c.index)
    assert texts == [c.message.content for c in out.choices]
    assert sorted(roles) == [0, 1]  # each choice's first delta carries the role


@pytest.mark.parametrize("n", [0, -1, 10**6])
def test_bad_n_is_400(server: ServerHandle, n: int) -> None:
    status, out = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": n})
    assert status == 400 and out["error"]["param"] == "n"


def test_stream_options_need_stream(server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    status, out = server.post("/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert status == 400 and out["error"]["param"] == "stream_options"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    status, out = server.post(
        "/v1/chat/completions", chat | {"stream": False, "stream_options": {"include_usage": True}}
    )
    assert status == 400 and out["error"]["param"] == "stream_options"
    status, out = server.post("/v1/completions", body | {"stream_options": None})
    assert status == 200, out
