"""The processes `kvtier bench router` starts — a redis-server, `kvtier serve` replicas, vllm-router
in front of them — and the scale-out tests start as well (tests/server/procs.py): each on a free
loopback port with its output in a log file, in a session of its own, so that a whole replica (its
HTTP and engine processes) is signalled, stopped or killed at once."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


class ProcessFailed(RuntimeError):
    """A process exited, or did not come up in time; the message ends with its log's tail."""


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit in this process (by default they end it at once),
    so the `finally` blocks that stop the processes it started run: those live in sessions of
    their own and would outlive it. Only from the main thread, and only over a default handler."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, stop)


EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range
LOWEST_PORT = 10000  # below: ports services commonly claim


def ephemeral_ports() -> tuple[int, int]:
    """The range [lo, hi] the OS hands out to outgoing connections and to binds of port 0."""
    try:
        lo, hi = (
            int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return lo, hi


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the OS's ephemeral range: a port from that range
    may be taken by any process's outgoing connection (a replica's to Redis, a client's) between
    this check and the bind of the server it is for, and the server then fails to start."""
    lo, hi = ephemeral_ports()
    spans = [(a, b) for a, b in ((LOWEST_PORT, lo - 1), (hi + 1, 65535)) if a <= b]
    rng = random.Random()
    for _ in range(100):
        a, b = rng.choice(spans) if spans else (LOWEST_PORT, 65535)
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ProcessFailed(f"no free port on 127.0.0.1 outside the ephemeral range {lo}-{hi}")


@dataclass
class Proc:
    """A started process: the port it listens on and the log its output goes to (named after
    the process: `replica0.log` is "replica0")."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def name(self) -> str:
        return self.log.stem

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check_alive(self) -> None:
        """ProcessFailed with the log's tail where the process has exited."""
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise ProcessFailed(f"{self.name} exited ({self.proc.returncode}); {self.log}:\n{tail}")

    def signal_all(self, sig: int) -> None:
        """`sig` to the process and its children (a replica's HTTP and engine processes)."""
        os.killpg(self.proc.pid, sig)


def spawn(cmd: list[str], log: Path, port: int) -> Proc:
    """`cmd` started in a session of its own, its output (stdout and stderr) into `log`."""
    with log.open("wb") as out:  # the child holds its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(port, proc, log)


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    """The status and body of GET `url`; status 0 where nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def healthy(p: Proc) -> bool:
    """GET /health answers 200 (a replica with its engine up; a router once a worker is up);
    ProcessFailed where the process has exited."""
    p.check_alive()
    return http_get(f"{p.url}/health", timeout=5)[0] == 200


def listening(p: Proc) -> bool:
    """The port takes a connection (redis-server); ProcessFailed where the process has exited."""
    p.check_alive()
    try:
        socket.create_connection(("127.0.0.1", p.port), timeout=1).close()
    except OSError:
        return False
    return True


def wait_for(procs: Iterable[Proc], ready: Callable[[Proc], bool], timeout: float) -> None:
    """Until `ready` holds for each process (`healthy`, `listening`); ProcessFailed after
    `timeout` seconds a process, or as soon as one exits."""
    for p in procs:
        deadline = time.monotonic() + timeout
        while not ready(p):
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{p.name} not {ready.__name__} after {timeout:.0f} s; see {p.log}"
                )
            time.sleep(0.2)


def stop(procs: Iterable[Proc], timeout: float = 20) -> None:
    """SIGTERM to each (SIGCONT first: a stopped process cannot act on it), then SIGKILL to the
    session of any still running after `timeout` seconds, and of any child its parent left."""
    procs = list(procs)
    for p in procs:
        if p.proc.poll() is None:
            _signal_group(p, signal.SIGCONT)
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.proc.wait(timeout)
        _signal_group(p, signal.SIGKILL)


def _signal_group(p: Proc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        p.signal_all(sig)


def redis_command(binary: str, port: int, folder: Path) -> list[str]:
    """redis-server on 127.0.0.1:`port`, without persistence, its working files in `folder`."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(folder)]  # fmt: skip


def vllm_router_command(binary: str, port: int, metrics_port: int, workers: list[str]) -> list[str]:
    """vllm-router on 127.0.0.1:`port` in front of `workers` (URLs), its Prometheus metrics on
    127.0.0.1:`metrics_port`; a policy and other flags go after."""
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    return [*cmd, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
