"""`/health` a router can trust: a real `kvtier serve` answers 503 while its engine process is
stopped (SIGSTOP) with a request in flight and 200 again after SIGCONT, the request then
completing; a server is warm (one forward run, native kernels loaded) before it answers at all.

Deadlines are generous and nothing is timed: the engine iteration timeout is 2 s, each wait for a
status polls for up to 120 s, so a loaded box only makes a test slower, never wrong (a stopped
process cannot beat, whatever the load)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from kvtier.engine.core import EngineCore
from tests.server.conftest import (
    MODEL,
    _health,
    free_port,
    serve_command,
    start_server,
    stop_server,
    wait_until,
)

ITERATION_TIMEOUT_S = 2.0
WAIT_S = 120.0


def _engine_pid(parent: int) -> int:
    """The spawned engine process among `parent`'s children (not multiprocessing's helpers)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine process under {parent}")


def _stream_to_end(port: int, out: dict[str, object], started: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    body = {"model": MODEL, "prompt": "The for", "max_tokens": 300, "ignore_eos": True}
    conn.request(
        "POST", "/v1/completions", json.dumps(body | {"stream": True}),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    out["status"] = resp.status
    lines = []
    for raw in resp:
        if raw.startswith(b"data: "):
            lines.append(raw)
            started.set()
    out["last"] = lines[-1] if lines else b""
    started.set()
    conn.close()


def test_a_stopped_engine_process_is_unhealthy_until_it_continues(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    cmd = serve_command(port, 512, 128)
    cmd += ["--engine-iteration-timeout-s", str(ITERATION_TIMEOUT_S), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = None
    try:
        wait_until(lambda: _health(port) == 200 or proc.poll() is not None, WAIT_S)
        assert proc.poll() is None, Path(log.name).read_text()
        engine = _engine_pid(proc.pid)
        out: dict[str, object] = {}
        started = threading.Event()
        client = threading.Thread(target=_stream_to_end, args=(port, out, started), daemon=True)
        client.start()
        assert started.wait(WAIT_S), Path(log.name).read_text()
        os.kill(engine, signal.SIGSTOP)
        wait_until(lambda: _health(port) == 503, WAIT_S)
        os.kill(engine, signal.SIGCONT)
        wait_until(lambda: _health(port) == 200, WAIT_S)
        client.join(WAIT_S)
        assert out["status"] == 200 and b"data: [DONE]" in out["last"]  # type: ignore[operator]
    finally:
        if engine is not None:
            os.kill(engine, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_health_names_the_stall() -> None:
    """The 503's message says what is wrong and which flag sets the deadline (an engine on a
    thread whose loop is held inside a call for longer than its deadline)."""
    handle = start_server(num_device_blocks=128, iteration_timeout_s=ITERATION_TIMEOUT_S)
    release = threading.Event()
    try:
        holder = threading.Thread(
            target=handle.engine.call, args=(lambda _: release.wait(WAIT_S), WAIT_S), daemon=True
        )
        holder.start()
        conn_status: dict[str, object] = {}

        def unhealthy() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=5)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            conn_status["body"] = resp.read()
            conn.close()
            return resp.status == 503

        wait_until(unhealthy, WAIT_S)
        assert b"--engine-iteration-timeout-s" in conn_status["body"]  # type: ignore[operator]
        release.set()
        holder.join(WAIT_S)
        wait_until(lambda: _health(handle.port) == 200, WAIT_S)
    finally:
        release.set()
        stop_server(handle)


def _warm(engine: EngineCore) -> tuple[int, int, int]:
    from kvtier.model import native

    stats = engine.stats()
    return stats.num_steps, stats.num_requests, native.kernels.cache_info().currsize


@pytest.mark.parametrize("engine_process", [True, False])
def test_the_server_is_warm_before_it_answers(engine_process: bool) -> None:
    """`start()` returns (and the port opens) only after a warm-up forward: the first client
    request never pays for building kernels or the first forward. The warm-up leaves no request
    behind."""
    handle = start_server(engine_process=engine_process, num_device_blocks=128)
    try:
        num_steps, num_requests, num_kernel_builds = handle.engine.call(_warm)
        assert num_steps >= 2 and num_requests == 0
        assert num_kernel_builds == 1
    finally:
        stop_server(handle)
