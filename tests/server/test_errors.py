"""OpenAI-shaped errors: 400 for bad parameters and over-long prompts, 404 for an unknown model,
429 when the waiting queue is full; nothing is left queued behind a refusal."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.server.conftest import MODEL, VLLM, ServerHandle, start_server, stop_server, wait_until

COMPLETION = {"model": MODEL, "prompt": "The for", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _error(payload: dict[str, Any]) -> dict[str, Any]:
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"temperature": -1.0}, None),
        ("/v1/completions", {"top_p": 0.0}, None),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"prompt": [5, 999_999]}, "prompt"),
        ("/v1/completions", {"repetition_penalty": 0.0}, "repetition_penalty"),
        ("/v1/completions", {"repetition_penalty": True}, "repetition_penalty"),
        ("/v1/completions", {"logit_bias": {"x": 1.0}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [5, 999_999]}, "allowed_token_ids"),
        ("/v1/completions", {"bad_words": [" "]}, "bad_words"),
        ("/v1/completions", {"bad_words": "word"}, "bad_words"),
        ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("/v1/completions", {"no_stop_trim": True}, "no_stop_trim"),
        ("/v1/completions", {"guided_regex": 5}, "guided_regex"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"truncate_prompt_tokens": 512}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/v1/chat/completions", {"max_completion_tokens": -5}, "max_completion_tokens"),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",  # auto, which this server was not started for
        ),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0",
        ),
    ],
)
def test_bad_parameters_are_400(
    server: ServerHandle, path: str, change: dict[str, Any], param: str | None
) -> None:
    body = (COMPLETION if path == "/v1/completions" else CHAT) | change
    status, payload = server.post(path, body)
    err = _error(payload)
    assert status == 400, payload
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


def test_invalid_json_is_400(server: ServerHandle) -> None:
    status, payload = server.post("/v1/completions", b'{"model": ')
    assert status == 400 and _error(payload)


def test_openai_client_raises_the_matching_errors(server: ServerHandle) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"use_beam_search": True})
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"


def test_prompt_longer_than_max_model_len_is_400(server: ServerHandle) -> None:
    status, payload = server.post("/v1/completions", COMPLETION | {"prompt": list(range(5, 600))})
    assert status == 400 and _error(payload)["code"] == "context_length_exceeded"
    long_text = "word " * 600
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}]
        )
    assert exc.value.code == "context_length_exceeded"
    assert server.engine.call(lambda e: e.stats().num_requests) == 0


def test_unknown_model_and_route_are_404(server: ServerHandle) -> None:
    status, payload = server.post("/v1/completions", COMPLETION | {"model": "nope"})
    assert status == 404 and _error(payload)["param"] == "model"
    status, payload = server.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and _error(payload)


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = COMPLETION | {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_backlog_beyond_free_slots_is_429_with_retry_after() -> None:
    handle = start_server(max_waiting_requests=1, max_num_seqs=1, num_device_blocks=256)
    try:
        running, resp_a = _open_stream(handle.port, 400)
        assert resp_a.status == 200 and resp_a.readline().startswith(b"data: ")
        waiting, _ = _open_stream(handle.port, 400)  # admitted to the queue, not running
        key = ("vllm:num_requests_waiting", VLLM)
        wait_until(lambda: handle.metrics()[key] == 1.0)
        with pytest.raises(openai.RateLimitError) as exc:
            handle.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.status_code == 429
        assert exc.value.response.headers["retry-after"] == "1"
        assert _error(exc.value.response.json())["code"] == "rate_limit_exceeded"
        assert handle.metrics()[("kvtier:request_rejected_total", (("status", "429"),))] == 1
        # a refused request counts once, however many choices it asked for
        status, _ = handle.post("/v1/completions", COMPLETION | {"n": 2})
        assert status == 429
        assert handle.metrics()[("kvtier:request_rejected_total", (("status", "429"),))] == 2
        running.close()
        waiting.close()
        wait_until(lambda: handle.engine.call(lambda e: e.stats().num_requests == 0))
        handle.engine.call(lambda e: e.check_integrity())
    finally:
        stop_server(handle)


def test_a_burst_that_fits_the_free_slots_is_never_refused() -> None:
    """--max-waiting-requests bounds the backlog beyond what can run: with 0, a burst of
    --max-num-seqs requests all run; one more than can start at once is a 429."""
    handle = start_server(
        max_waiting_requests=0, max_num_seqs=6, num_device_blocks=1024, max_model_len=2048
    )
    try:
        body = COMPLETION | {"max_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: handle.post("/v1/completions", body), range(6)))
        assert [status for status, _ in replies] == [200] * 6, replies
        streams = [_open_stream(handle.port, 2000) for _ in range(6)]  # every slot busy
        for _, resp in streams:
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert handle.engine.call(lambda e: e.stats().num_running) == 6
        status, payload = handle.post("/v1/completions", body)
        assert status == 429 and _error(payload)["type"] == "rate_limit_exceeded"
        for conn, _ in streams:
            conn.close()
        wait_until(lambda: handle.engine.call(lambda e: e.stats().num_requests == 0))
    finally:
        stop_server(handle)
