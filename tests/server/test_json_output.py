"""Whatever a client sends, the server answers in valid JSON (strict: no NaN or Infinity) and
valid SSE: non-finite logprobs are clamped to -9999.0 as vLLM does, and a lone UTF-16 surrogate
in any text field is a 400 naming the field, not a 500."""

from __future__ import annotations

import http.client
import json
import math
from typing import Any

import pytest

from kvtier.server.errors import dumps
from kvtier.server.events import TokenLogprob
from kvtier.server.logprobs import chat_logprobs, completion_logprobs
from tests.server.conftest import MODEL, ServerHandle

COMPLETION = {"model": MODEL, "prompt": "The for", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _no_constants(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def strict_loads(text: str | bytes) -> Any:
    """json.loads that refuses NaN / Infinity (Python's own json accepts them)."""
    return json.loads(text, parse_constant=_no_constants)


def raw_post(server: ServerHandle, path: str, body: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type", ""), resp.read()
    conn.close()
    return out


def sse_events(payload: bytes) -> list[Any]:
    events = [e for e in payload.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert all(e.startswith("data: ") for e in events)
    return [strict_loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_non_finite_logprobs_render_as_valid_json() -> None:
    inf, nan = float("inf"), float("nan")
    lps = [TokenLogprob("a", -inf, [("a", -inf), ("b", nan), ("c", -0.5)], 1, [1, 2, 3])]
    completion = completion_logprobs(lps, 0)
    assert completion["token_logprobs"] == [-9999.0]
    assert completion["top_logprobs"] == [{"a": -9999.0, "b": -9999.0, "c": -0.5}]
    chat = chat_logprobs(lps)["content"][0]
    assert chat["logprob"] == -9999.0
    assert [t["logprob"] for t in chat["top_logprobs"]] == [-9999.0, -9999.0, -0.5]
    strict_loads(dumps(completion))
    with pytest.raises(ValueError):
        dumps({"x": math.inf})  # strict: a non-finite float that slipped through is a bug


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_filtered_candidates_are_valid_json(
    server: ServerHandle, stream: bool
) -> None:
    # top_k=2 filters all but 2 tokens; 5 candidates were asked for (-inf in the processed
    # distribution before the sampler returned the raw one)
    body = COMPLETION | {"logprobs": 5, "top_k": 2, "seed": 1, "stream": stream}
    status, _, payload = raw_post(server, "/v1/completions", json.dumps(body).encode())
    assert status == 200, payload
    chunks = sse_events(payload) if stream else [strict_loads(payload)]
    tops = [t for c in chunks for t in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert tops and all(len(t) == 5 for t in tops)
    assert all(math.isfinite(v) for t in tops for v in t.values())
    body = CHAT | {"logprobs": True, "top_logprobs": 5, "top_k": 2, "seed": 1, "stream": stream}
    status, _, payload = raw_post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, payload
    chunks = sse_events(payload) if stream else [strict_loads(payload)]
    assert all(
        math.isfinite(t["logprob"])
        for c in chunks
        for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]
        for t in e["top_logprobs"]
    )


SURROGATE = "\ud800"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x" + SURROGATE]}, "prompt.1"),
        ("/v1/completions", {"stop": [SURROGATE]}, "stop.0"),
        ("/v1/completions", {"model": SURROGATE}, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]},
            "messages.0.name",
        ),
        ("/v1/chat/completions", {"stop": SURROGATE}, "stop"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(
    server: ServerHandle, path: str, change: dict[str, Any], param: str, stream: bool
) -> None:
    body = (COMPLETION if path == "/v1/completions" else CHAT) | change | {"stream": stream}
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
    assert b"\\ud800" in raw
    status, kind, payload = raw_post(server, path, raw)
    assert status == 400, payload
    assert kind.startswith("application/json")
    err = strict_loads(payload)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_lone_surrogate_in_an_unknown_field_name_still_answers_json(server: ServerHandle) -> None:
    raw = json.dumps(COMPLETION | {SURROGATE: 1}).encode()
    status, kind, payload = raw_post(server, "/v1/completions", raw)
    assert status == 400 and kind.startswith("application/json")
    err = strict_loads(payload.decode("utf-8"))["error"]  # valid UTF-8 too
    assert err["type"] == "invalid_request_error" and err["message"]
