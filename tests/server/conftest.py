"""A real kvtier server on 127.0.0.1 (free port): uvicorn in a background thread, the engine on its
own thread with one torch thread (or, with `engine_process=True`, in a process of its own as
`kvtier serve` runs it). `ServerHandle.engine` lets tests run checks on the engine thread."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.procs import Proc, healthy, spawn, stop, wait_for
from kvtier.bench.procs import free_port as free_port  # the server tests' ports
from kvtier.engine.params import EngineArgs
from kvtier.server import EngineLoop, build_app
from kvtier.server.cli import make_server
from kvtier.server.engine_process import EngineProcess
from kvtier.server.events import EngineClient

MODEL = "kvtier-default"
# The labels of every vLLM-shaped series of a server with the default names (`MetricNames`)
VLLM = (("engine", "0"), ("model_name", MODEL))


@dataclass
class ServerHandle:
    engine: EngineClient
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, payload = resp.status, json.loads(resp.read())
        conn.close()
        return status, payload

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def start_server(
    max_waiting_requests: int = 64,
    fail_at_step: int | None = None,
    engine_process: bool = False,
    iteration_timeout_s: float = 30.0,
    kv_events: Any = None,  # a server.kv_events.KVEventsConfig
    **engine_kwargs: Any,
) -> ServerHandle:
    kwargs = {"max_model_len": 512, "torch_threads": 1} | engine_kwargs
    if kv_events is not None:
        kwargs["enable_kv_cache_events"] = kv_events.publishes
    args = EngineArgs.from_kwargs(None, **kwargs)
    engine: EngineClient
    if engine_process:
        engine = EngineProcess(
            args,
            max_waiting_requests,
            fail_at_step,
            "warning",
            iteration_timeout_s,
            kv_events=kv_events,
        )
    else:
        engine = EngineLoop(
            args, max_waiting_requests, fail_at_step, None, iteration_timeout_s, kv_events=kv_events
        )
    engine.start()
    app = build_app(engine, MODEL)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # log_config=None: uvicorn's records reach the root logger, so tests can assert on them
    config = uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None)
    server = make_server(engine, app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    handle = ServerHandle(engine, app, server, thread, port)
    wait_until(lambda: _health(port) == 200, 120)
    return handle


def stop_server(handle: ServerHandle) -> None:
    handle.server.should_exit = True
    handle.thread.join(10)
    handle.engine.stop()


def serve_command(port: int, max_model_len: int, num_device_blocks: int) -> list[str]:
    """`kvtier serve` of the embedded model on `port`, one torch thread."""
    return [
        sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port),
        "--max-model-len", str(max_model_len), "--num-device-blocks", str(num_device_blocks),
        "--torch-threads", "1",
    ]  # fmt: skip


@contextmanager
def serving(cmd: list[str], port: int, log: Path, timeout_s: float = 120) -> Iterator[Proc]:
    """`cmd` (a `kvtier serve` on `port`, e.g. `serve_command`'s) started in a session of its own
    with its output in `log`, yielded once it answers /health (failing with the log as soon as
    it exits), stopped with its children after."""
    proc = spawn(cmd, log, port)
    try:
        wait_for([proc], healthy, timeout_s)
        yield proc
    finally:
        stop([proc])


def _health(port: int) -> int:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return 0


def wait_until(cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def server() -> Iterator[ServerHandle]:
    handle = start_server(max_num_seqs=8, num_device_blocks=512)
    yield handle
    stop_server(handle)
