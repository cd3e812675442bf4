"""What one request may cost the server: bodies over --max-request-body-bytes are a 413 before
anything is parsed (declared or chunked), prompts are tokenized off the engine thread, stop lists
and logprob counts are bounded, and JSON's NaN / Infinity are refused — each a 400 or 413 naming
the parameter, while other requests keep streaming."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.conftest import MODEL, ServerHandle

COMPLETION = {"model": MODEL, "prompt": "The for", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(port: int, body: bytes | Iterator[bytes], chunked: bool = False) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    conn.request("POST", "/v1/completions", body, headers, encode_chunked=chunked)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _open_stream(port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = COMPLETION | {"max_tokens": 200, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp


def _error(payload: dict[str, Any]) -> dict[str, Any]:
    assert set(payload) == {"error"} and set(payload["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    return payload["error"]


def test_oversized_bodies_are_413_and_streams_keep_flowing(server: ServerHandle) -> None:
    conn, stream = _open_stream(server.port)
    big = json.dumps(COMPLETION | {"prompt": "word " * 2_000_000}).encode()  # 10 MB
    assert len(big) > 4 << 20
    status, payload = _post(server.port, big)  # Content-Length says it all: refused unread
    assert status == 413, payload
    assert "--max-request-body-bytes" in _error(payload)["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    status, payload = _post(server.port, chunks(), chunked=True)
    assert status == 413 and _error(payload)["code"] == "request_too_large"
    events = [e for e in stream.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text  # the stream ran to its end beside the refusals
    status, payload = _post(server.port, json.dumps(COMPLETION).encode(), chunked=True)
    assert status == 200, payload  # a small chunked body is fine


def test_prompts_are_tokenized_off_the_engine_thread(server: ServerHandle) -> None:
    tokenizer = server.engine.call(lambda e: e.tokenizer)  # shared with the HTTP side
    threads: list[str] = []
    encode = tokenizer.encode

    def recording_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    tokenizer.encode = recording_encode  # type: ignore[method-assign]
    try:
        status, payload = _post(server.port, json.dumps(COMPLETION).encode())
        assert status == 200, payload
        long_prompt = COMPLETION | {"prompt": "The while statement " * 20_000}  # 80k tokens
        status, payload = _post(server.port, json.dumps(long_prompt).encode())
        assert status == 400 and _error(payload)["code"] == "context_length_exceeded"
        chat = server.client().chat.completions.create(**CHAT)  # type: ignore[call-overload]
        assert chat.choices[0].message.content is not None
    finally:
        del tokenizer.encode
    assert len(threads) >= 3  # the long prompt is counted in chunks
    assert "kvtier-engine" not in threads, threads
    assert threading.current_thread().name not in threads  # nor the test's own thread


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"stop": [f"s{i}" for i in range(33)]}, "stop"),
        ("/v1/completions", {"stop": "x" * 513}, "stop"),
        ("/v1/chat/completions", {"stop": ["ok", "y" * 513]}, "stop"),
        ("/v1/completions", {"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"seed": 2**63}, "seed"),
    ],
)
def test_bounded_parameters_are_400(
    server: ServerHandle, path: str, change: dict[str, Any], param: str
) -> None:
    body = (COMPLETION if path == "/v1/completions" else CHAT) | change
    status, payload = server.post(path, body)
    assert status == 400, payload
    assert _error(payload)["param"] == param


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_nan_and_infinity_in_the_body_are_400(
    server: ServerHandle, field: str, literal: str
) -> None:
    raw = json.dumps(COMPLETION)[:-1] + f', "{field}": {literal}}}'
    status, payload = server.post("/v1/completions", raw.encode())
    assert status == 400, payload
    assert _error(payload)["param"] == field
