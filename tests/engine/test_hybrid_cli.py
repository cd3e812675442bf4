"""`kvtier generate` and `kvtier serve` on the Mamba2 hybrids (tiny Falcon-H1 and Granite 4.0 hybrid
folders): the engine serves them like any decoder (architecture.md §State)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import uvicorn

from kvtier.cli import main
from kvtier.engine.params import EngineArgs
from kvtier.model.testing import HYBRID_ARCHITECTURES, write_tiny_model
from kvtier.server import EngineLoop, build_app
from kvtier.server.cli import make_server
from tests.server.conftest import ServerHandle, stop_server, wait_until


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_kvtier_generate_runs_a_hybrid_folder(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_tiny_model(tmp_path / arch, arch)
    argv = ["generate", "--model", str(folder), "--max-tokens", "12", "--device", "sim"]
    assert main([*argv, "--async-depth", "3", "--num-speculative-tokens", "3", "Once"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Once") and "12 tokens" in out.err


def test_kvtier_serve_answers_completions_from_a_hybrid(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "falcon_h1", "falcon_h1")
    args = EngineArgs.from_kwargs(str(folder), max_model_len=128, torch_threads=1)
    engine = EngineLoop(args, 16)
    engine.start()
    app = build_app(engine, "falcon-h1-toy")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None)
    server = make_server(engine, app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    handle = ServerHandle(engine, app, server, thread, sock.getsockname()[1])
    try:
        wait_until(lambda: _up(handle), 120)
        body = {"model": "falcon-h1-toy", "prompt": "Once", "max_tokens": 8, "temperature": 0}
        status, payload = handle.post("/v1/completions", body)
        assert status == 200, payload
        assert payload["usage"]["completion_tokens"] == 8
        again = handle.post("/v1/completions", body)[1]  # greedy: the same text again
        assert again["choices"][0]["text"] == payload["choices"][0]["text"]
    finally:
        stop_server(handle)


def _up(handle: ServerHandle) -> bool:
    try:
        handle.metrics()
    except OSError:
        return False
    return True
