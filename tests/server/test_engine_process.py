"""`kvtier serve`'s default: the engine in a process of its own. Same answers as the engine on a
thread; aborts, metrics and checks cross the pipe; a failing or killed engine process answers
every request in flight, stops the server and leaves no process behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvtier.engine.params import EngineArgs
from kvtier.server.engine_process import EngineProcess
from tests.server import probes
from tests.server.conftest import (
    MODEL,
    VLLM,
    ServerHandle,
    _health,
    free_port,
    serve_command,
    start_server,
    stop_server,
    wait_until,
)

LONG = {"model": MODEL, "prompt": "The for", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def proc_server() -> Iterator[ServerHandle]:
    handle = start_server(engine_process=True, max_num_seqs=8, num_device_blocks=512)
    yield handle
    stop_server(handle)


def _error(payload: dict[str, Any]) -> dict[str, Any]:
    assert set(payload) == {"error"}
    return payload["error"]  # type: ignore[no-any-return]


def _stream(handle: ServerHandle, body: dict[str, Any]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
    conn.request(
        "POST", "/v1/completions", json.dumps(body | {"stream": True}),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert resp.readline() == b"\n"  # the rest starts at an event, whatever came before the end
    return resp


def test_the_engine_runs_in_another_process(proc_server: ServerHandle) -> None:
    child = proc_server.engine.call(probes.pid)
    assert child != os.getpid() and child == proc_server.engine.pid  # type: ignore[attr-defined]


def test_same_answers_as_the_engine_on_a_thread(
    server: ServerHandle, proc_server: ServerHandle
) -> None:
    """Greedy completions, chat, streamed text, logprobs and usage match field for field."""

    def answers(handle: ServerHandle) -> list[Any]:
        client = handle.client()
        out: list[Any] = []
        for prompt in ("The with statement", "def f(x):", "import"):
            c = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2
            )
            assert c.usage is not None and c.choices[0].logprobs is not None
            out.append((c.choices[0].text, c.choices[0].logprobs.token_logprobs))
            out.append((c.usage.prompt_tokens, c.usage.completion_tokens))
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9, n=2, seed=3,
            temperature=0.8,
        )  # fmt: skip
        out.append([choice.message.content for choice in chat.choices])
        stream = client.completions.create(
            model=MODEL, prompt=["a", "bb"], max_tokens=6, temperature=0, stream=True
        )
        texts = ["", ""]
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        out.append(texts)
        return out

    assert answers(proc_server) == answers(server)


def test_disconnect_aborts_in_the_engine_process(proc_server: ServerHandle) -> None:
    engine = proc_server.engine
    wait_until(lambda: engine.call(probes.idle))
    resp = _stream(proc_server, LONG)
    wait_until(lambda: engine.call(probes.num_requests) == 1)
    assert engine.call(probes.pools_intact)[0] > 0  # the request holds blocks mid-decode
    resp.close()
    wait_until(lambda: engine.call(probes.idle))
    wait_until(lambda: engine.call(probes.pools_intact) == (0.0, 0))


def test_metrics_come_from_the_engine_process(proc_server: ServerHandle) -> None:
    before = proc_server.metrics()
    proc_server.client().completions.create(
        model=MODEL, prompt="The class", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = proc_server.metrics()
    key = ("vllm:generation_tokens_total", VLLM)
    assert after[key] - before[key] == 5
    assert after[("kvtier:kv_cache_num_blocks", (("tier", "device"),))] == 511


def test_call_refuses_a_function_it_cannot_send(proc_server: ServerHandle) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        proc_server.engine.call(lambda e: e.stats())
    assert proc_server.engine.call(probes.idle) in (True, False)  # the pipe still works


def test_engine_failure_answers_requests_and_stops_the_server() -> None:
    handle = start_server(engine_process=True, fail_at_step=40, max_num_seqs=4)
    try:
        resp = _stream(handle, LONG)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(handle.post, "/v1/completions", LONG)
            status, payload = whole.result(60)
        assert status == 500, payload
        assert "injected fault at engine step 40" in _error(payload)["message"]
        events = [e for e in resp.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        streamed = _error(json.loads(events[-2].removeprefix("data: ")))
        assert "injected fault at engine step 40" in streamed["message"]
        handle.thread.join(30)
        assert not handle.thread.is_alive(), "uvicorn kept serving after the engine died"
        health = TestClient(handle.app).get("/health")
        assert health.status_code == 503 and "injected fault" in _error(health.json())["message"]
        assert isinstance(handle.engine.error, RuntimeError)
    finally:
        stop_server(handle)
    assert not handle.engine.is_alive


def test_a_killed_engine_process_fails_requests_in_flight() -> None:
    handle = start_server(engine_process=True, max_num_seqs=4)
    try:
        resp = _stream(handle, LONG)
        pid = handle.engine.call(probes.pid)
        os.kill(pid, signal.SIGKILL)
        events = [e for e in resp.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        message = _error(json.loads(events[-2].removeprefix("data: ")))["message"]
        assert "the engine process exited unexpectedly (exit code -9)" in message
        handle.thread.join(30)
        assert not handle.thread.is_alive(), "uvicorn kept serving after the engine died"
        status, payload = TestClient(handle.app).post("/v1/completions", json=LONG).status_code, {}
        assert status in (500, 503), payload
    finally:
        stop_server(handle)


def test_stop_ends_the_engine_process_without_an_error() -> None:
    engine = EngineProcess(
        EngineArgs.from_kwargs(None, max_model_len=128, torch_threads=1), 8, None, "warning"
    )
    engine.start()
    pid = engine.call(probes.pid)
    engine.stop()
    assert engine.error is None and not engine.is_alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_stop_kills_an_engine_process_that_does_not_stop() -> None:
    """A hung engine thread keeps its process from exiting on "stop"; it ignores SIGTERM, so
    `stop` kills it once its timeout passes."""
    engine = EngineProcess(
        EngineArgs.from_kwargs(None, max_model_len=128, torch_threads=1), 8, None, "warning"
    )
    engine.start()
    pid = engine.call(probes.pid)
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(engine.call, probes.stall, 120.0)
        wait_until(lambda: stalled.running(), 10)
        engine.stop(timeout=1.0)
        with pytest.raises(RuntimeError, match="has stopped"):
            stalled.result(10)  # the reader answers calls left open
    assert not engine.is_alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_start_failure_is_raised_in_the_http_process() -> None:
    args = EngineArgs.from_kwargs(None, max_model_len=128, torch_threads=1, num_device_blocks=2)
    engine = EngineProcess(args, 8, None, "warning")
    with pytest.raises(ValueError, match="raise --num-device-blocks to ≥ 25"):
        engine.start()
    assert not engine.is_alive


def test_ctrl_c_to_the_process_group_shuts_down_cleanly(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the group: the engine process leaves shutdown to the
    server, which drains, stops the engine (its tiers close) and exits 0."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    cmd = serve_command(port, 128, 64)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: _health(port) == 200 or proc.poll() is not None, 60)
        assert proc.poll() is None, Path(log.name).read_text()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, Path(log.name).read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = Path(log.name).read_text()
    assert "exited unexpectedly" not in text and "Traceback" not in text, text


def test_refusals_of_the_http_process_reach_the_engine_processs_counter(
    proc_server: ServerHandle,
) -> None:
    """The rejection counter lives with the engine's metrics in the engine process: the HTTP
    layer's refusals are sent there, once per request."""
    key = ("kvtier:request_rejected_total", (("status", "400"),))
    before = proc_server.metrics().get(key, 0.0)
    status, payload = proc_server.post(
        "/v1/completions", {"prompt": "x", "n": 32, "max_tokens": 2, "prompt_logprobs": -1}
    )
    assert status == 400, payload
    status, payload = proc_server.post("/v1/completions", {"prompt": ["a"] * 3, "n": 32})
    assert status == 400 and _error(payload)["code"] == "too_many_choices"
    assert proc_server.metrics()[key] == before + 2
