"""Processes of a comparison: a JSON-line worker (a script that answers one line per request), a
one-shot JSON script, and an HTTP server polled until /health answers. Each has a timeout and is
ended by its own process group, never by name."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvtier.bench.procs import exit_on_signals


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the live processes `pids` have used (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    return total / tick


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (a peer engine is several processes)."""
    return cpu_seconds([pid, *descendants(pid)])


@contextlib.contextmanager
def paused(pid: int | None) -> Iterator[None]:
    """SIGSTOP `pid` and its descendants for the block, SIGCONT after (None: nothing to pause).

    An idle engine still polls (vLLM's processes use ~0.15 core waiting for work): paused, it
    takes no CPU from the engine being measured."""
    pids = [] if pid is None else [pid, *descendants(pid)]
    if os.getpid() in pids:
        raise ValueError(f"refusing to pause pid {pid}: our own process is in its tree")
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def last_json(text: str, kind: str | None = None) -> dict[str, Any]:
    """The last line of `text` that parses as a JSON object (of `kind`, when given)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and (kind is None or obj.get("kind") == kind):
            return obj
    raise RuntimeError(f"no JSON object{f' of kind {kind!r}' if kind else ''} in the output")


def run_json(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    """Run a script to completion; stderr goes to `log`; returns its last JSON line."""
    with log.open("a") as err:
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                             timeout=timeout, check=False)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"{argv[1]} exited {res.returncode}; see {log}")
    return last_json(res.stdout)


def _stop(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace)
    except ProcessLookupError:
        pass


class LineWorker:
    """A script that prints {"kind": "ready"} once loaded, then one JSON line per stdin line."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, timeout: float) -> None:
        exit_on_signals()
        self.log = log
        self._err: IO[str] = log.open("a")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env=env, start_new_session=True)  # fmt: skip
        self.ready = self._read("ready", timeout)

    def _read(self, kind: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        # INVARIANT: the worker writes whole lines and nothing else on stdout but stray prints.
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer worker exited ({self.proc.poll()}); see {self.log}")
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("kind") == kind:
                return obj
        raise TimeoutError(f"peer worker gave no {kind!r} line in {timeout:.0f} s; see {self.log}")

    def ask(self, request: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read("round", timeout)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            _stop(self.proc)
        self._err.close()


class Server:
    """An OpenAI-compatible server process on 127.0.0.1:`port`, ready once /health answers 200."""

    def __init__(
        self, argv: list[str], port: int, env: dict[str, str], log: Path, timeout: float
    ) -> None:
        exit_on_signals()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        self._err = log.open("a")
        self.proc = subprocess.Popen(argv, stdout=self._err, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                self._err.close()
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {log}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"server not healthy in {timeout:.0f} s; see {log}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def close(self) -> None:
        _stop(self.proc)
        self._err.close()
