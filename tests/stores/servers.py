"""Real `redis-server` processes for the store tests, on free loopback ports: one standalone
server, or a three-master Cluster. Never a mock: a test that needs Redis fails when the binary is
missing (`.ci/run` installs Debian's package)."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from kvtier.bench.procs import free_port, redis_command


def redis_binary(name: str = "redis-server") -> str:
    """The path of `name`; fails the test (never skips) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed; run `apt-get install -y redis-server` (.ci/run does) — "
            "the remote-store tests run against a real Redis"
        )
    return path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port P ≤ 55535 whose cluster bus port P + 10000 is free too."""
    for _ in range(1000):
        port = random.randrange(20000, 55536)
        if _free(port) and _free(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


def wait_until(cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1:`port`, no persistence; `start` waits for PING."""

    folder: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [*redis_command(redis_binary(), self.port, self.folder), *self.extra]
        log = (self.folder / f"redis-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers)
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = (self.folder / f"redis-{self.port}.log").read_text()
            raise AssertionError(f"redis-server exited: {log[-2000:]}")
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run, its data with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_cluster(folder: Path, num_masters: int = 3) -> list[RedisServer]:
    """`num_masters` cluster-enabled servers joined by `redis-cli --cluster create`; returns once
    every node reports `cluster_state:ok`."""
    nodes: list[RedisServer] = []
    try:
        for i in range(num_masters):
            extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]
            extra += ["--cluster-config-file", f"nodes-{i}.conf"]
            nodes.append(RedisServer(folder / f"node{i}", extra, free_cluster_port()).start())
        cmd = [redis_binary("redis-cli"), "--cluster", "create"]
        cmd += [f"127.0.0.1:{n.port}" for n in nodes]
        cmd += ["--cluster-replicas", "0", "--cluster-yes"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stdout + out.stderr

        def ok() -> bool:
            for n in nodes:
                with n.client() as c:
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
            return True

        wait_until(ok)
    except BaseException:
        for n in nodes:  # never leave a half-made cluster running
            n.stop()
        raise
    return nodes
