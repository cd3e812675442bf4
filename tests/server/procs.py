"""Real processes for the scale-out tests: `kvtier serve` replicas and the routers in front of
them (vllm-router, sglang-router), started, awaited and stopped as `kvtier bench router` starts
its own (kvtier.bench.procs: each on a free loopback port with its log in a file, in a session
of its own so a test can stop or kill a whole replica), and the requests the tests send them."""

from __future__ import annotations

import http.client
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.procs import (
    Proc,
    free_port,
    healthy,
    spawn,
    vllm_router_command,
    wait_for,
)


def _start(args: list[str], log: Path) -> Proc:
    """`kvtier <args> --port P` (a replica: `args` starts with "serve")."""
    port = free_port()
    return spawn([sys.executable, "-m", "kvtier.cli", *args, "--port", str(port)], log, port)


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not installed: pip install -e '.[dev]' (kvtier[router])")
    return path


def start_vllm_router(replicas: list[Proc], log: Path, *flags: str) -> tuple[Proc, int]:
    """vllm-router in front of `replicas`; returns it and its Prometheus port. Health checks
    every second, a replica out after one failed check, so the tests wait seconds, not minutes."""
    port, metrics_port = free_port(), free_port()
    cmd = vllm_router_command(binary("vllm-router"), port, metrics_port, [r.url for r in replicas])
    cmd += ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "1"]
    cmd += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
    cmd += ["--worker-startup-check-interval", "1", *flags]
    return spawn(cmd, log, port), metrics_port


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


def wait_ready(procs: list[Proc], timeout_s: float = 180) -> None:
    """Until each answers /health (replicas, routers); fails as soon as one exits."""
    wait_for(procs, healthy, timeout_s)
