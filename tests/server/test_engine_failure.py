"""A failing engine thread takes the server down cleanly, as vLLM's API server does: requests in
flight get an OpenAI-shaped 500 (an error event on a stream), /health says 503, uvicorn stops and
`kvtier serve` exits 1 with the cause and its traceback in the log."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.server.conftest import (
    MODEL,
    _health,
    free_port,
    serve_command,
    start_server,
    stop_server,
    wait_until,
)

LONG = {"model": MODEL, "prompt": "The for", "max_tokens": 400, "ignore_eos": True}


def _error(payload: dict[str, Any]) -> dict[str, Any]:
    assert set(payload) == {"error"}
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_engine_failure_answers_requests_in_flight_and_stops_the_server() -> None:
    handle = start_server(max_num_seqs=4, num_device_blocks=128)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
        body = json.dumps(LONG | {"stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert resp.readline() == b"\n"  # the rest starts at an event boundary
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(handle.post, "/v1/completions", LONG)
            wait_until(lambda: handle.engine.call(lambda e: e.stats().num_requests) == 2)

            def boom() -> None:
                raise RuntimeError("injected step failure")

            handle.engine.call(lambda e: setattr(e, "step", boom))  # the next step raises
            status, payload = whole.result(30)
        assert status == 500, payload
        err = _error(payload)
        assert err["type"] == "server_error" and "injected step failure" in err["message"]
        events = [e for e in resp.read().decode().split("\n\n") if e]
        conn.close()
        assert events[-1] == "data: [DONE]"
        streamed = _error(json.loads(events[-2].removeprefix("data: ")))
        assert "injected step failure" in streamed["message"]
        handle.thread.join(30)
        assert not handle.thread.is_alive(), "uvicorn kept serving after the engine died"
        assert _health(handle.port) == 0  # nothing listens any more
        health = TestClient(handle.app).get("/health")  # the app itself, after the server stopped
        assert health.status_code == 503 and "injected" in _error(health.json())["message"]
    finally:
        stop_server(handle)


def test_kvtier_serve_exits_1_with_the_cause_logged(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    cmd = serve_command(port, 128, 32)
    env = os.environ | {"KVTIER_DEBUG_FAIL_AT_STEP": "2"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: _health(port) == 200 or proc.poll() is not None, 60)
        assert proc.poll() is None, Path(log.name).read_text()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"model": MODEL, "prompt": "The with statement", "max_tokens": 8}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        status, payload = resp.status, json.loads(resp.read())
        conn.close()
        assert status == 500 and "injected fault at engine step 2" in _error(payload)["message"]
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = Path(log.name).read_text()
    assert "engine loop failed" in text and "Traceback" in text
    assert "RuntimeError: injected fault at engine step 2" in text
    assert "exiting: the engine failed" in text
