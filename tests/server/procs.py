"""Real processes for the scale-out tests: `kvtier serve` replicas and the routers in front of
them (vllm-router, sglang-router), each on a free loopback port with its log in a file, each in a
session of its own so a test can stop or kill a whole replica (HTTP and engine processes)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.server.conftest import _health, wait_until
from tests.stores.servers import free_port


@dataclass
class Proc:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal_all(self, sig: int) -> None:
        """`sig` to the process and its children (a replica's HTTP and engine processes)."""
        os.killpg(self.proc.pid, sig)


def spawn(cmd: list[str], log: Path, port: int) -> Proc:
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    return Proc(port, proc, log)


def _start(args: list[str], log: Path) -> Proc:
    """`kvtier <args> --port P` (a replica: `args` starts with "serve")."""
    port = free_port()
    return spawn([sys.executable, "-m", "kvtier.cli", *args, "--port", str(port)], log, port)


def _ready(p: Proc) -> bool:
    assert p.proc.poll() is None, p.log.read_text()[-3000:]
    return _health(p.port) == 200


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not installed: pip install -e '.[dev]' (kvtier[router])")
    return path


def start_vllm_router(replicas: list[Proc], log: Path, *flags: str) -> tuple[Proc, int]:
    """vllm-router in front of `replicas`; returns it and its Prometheus port. Health checks
    every second, a replica out after one failed check, so the tests wait seconds, not minutes."""
    port, metrics_port = free_port(), free_port()
    cmd = [binary("vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *[r.url for r in replicas]]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    cmd += ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "1"]
    cmd += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
    cmd += ["--worker-startup-check-interval", "1", *flags]
    return spawn(cmd, log, port), metrics_port


def router_ready(router: Proc) -> bool:
    """The router answers /health (vllm-router and sglang-router: 200 once a worker is up)."""
    assert router.proc.poll() is None, router.log.read_text()[-3000:]
    return _health(router.port) == 200


def request(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def metric(port: int, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples whose labels contain `labels` (e.g. 'worker="http://…"')."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    total = 0.0
    for line in text.splitlines():
        series = line.rsplit(" ", 1)[0]
        if (series == name or series.startswith(name + "{")) and labels in series:
            total += float(line.split()[-1])
    return total


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            with_group(p, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(20)
        except subprocess.TimeoutExpired:
            with_group(p, signal.SIGKILL)
            p.proc.wait(20)
        with_group(p, signal.SIGKILL)  # a child the parent left behind


def with_group(p: Proc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        p.signal_all(sig)


def wait_ready(procs: list[Proc], timeout_s: float = 180) -> None:
    for p in procs:
        wait_until(lambda p=p: _ready(p), timeout_s)  # type: ignore[misc]
