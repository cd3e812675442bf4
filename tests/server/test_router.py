"""`kvtier router` in front of two real `kvtier serve` processes (free loopback ports): a returning
conversation goes back to the replica that served it (and hits its prefix cache there), streams
pass through unchanged, and killing a replica mid-run loses no request."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.server.ring import HashRing, route_key
from tests.server.conftest import MODEL, _health, wait_until
from tests.stores.servers import free_port


@dataclass
class Proc:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _start(args: list[str], log: Path) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier.cli", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Proc(port, proc, log)


def _ready(p: Proc) -> bool:
    assert p.proc.poll() is None, p.log.read_text()[-3000:]
    return _health(p.port) == 200


def request(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def metric(port: int, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples whose labels contain `labels` (e.g. 'replica="http://…"')."""
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


@dataclass
class Setup:
    replicas: list[Proc]
    router: Proc

    def owner(self, path: str, body: dict[str, Any]) -> str:
        ring = HashRing([r.url for r in self.replicas])
        return ring.order(route_key(path, body, 256))[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("router")
    serve = [
        "serve",
        "--max-model-len",
        "512",
        "--num-device-blocks",
        "256",
        "--torch-threads",
        "1",
    ]
    replicas = [_start(serve, folder / f"replica{i}.log") for i in range(2)]
    routed = ["router", "--health-interval-s", "0.2", "--load-factor", "4"]  # pure ring order
    routed += ["--max-request-body-bytes", "1MiB"]
    for r in replicas:
        routed += ["--replica", r.url]
    router = _start(routed, folder / "router.log")
    try:
        for p in replicas:
            wait_until(lambda p=p: _ready(p), 120)  # type: ignore[misc]
        wait_until(lambda: _ready(router), 120)
        labels = ",".join(f'replica="{r.url}"' for r in replicas)
        wait_until(
            lambda: all(
                metric(router.port, "kvtier:router_replica_up", f'replica="{r.url}"') == 1
                for r in replicas
            ),
            120,
        )
        assert labels
        yield Setup(replicas, router)
    finally:
        for p in [router, *replicas]:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in [router, *replicas]:
            try:
                p.proc.wait(20)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def chat_body(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["user", "assistant"] * len(contents)
    msgs = [{"role": "system", "content": "You answer questions about Python statements."}]
    msgs += [{"role": r, "content": c} for r, c in zip(roles, contents)]
    return {"model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0} | extra


def test_a_returning_conversation_goes_back_to_its_replica(setup: Setup) -> None:
    path = "/v1/chat/completions"
    served = set()
    for topic in ("import", "while", "class", "with", "return", "yield"):
        first = chat_body(f"What does the {topic} statement do?")
        status, headers, raw = request(setup.router.port, path, first)
        assert status == 200, raw
        replica = headers["x-kvtier-replica"]
        assert replica == setup.owner(path, first)
        reply = json.loads(raw)["choices"][0]["message"]["content"]
        again = chat_body(f"What does the {topic} statement do?", reply, "Show an example.")
        status, headers, raw = request(setup.router.port, path, again)
        assert status == 200 and headers["x-kvtier-replica"] == replica
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0  # the replica still held the conversation's prefix
        served.add(replica)
    assert served <= {r.url for r in setup.replicas}


def _sse(port: int, path: str, body: dict[str, Any]) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    return events


def test_streams_pass_through_with_the_same_tokens(setup: Setup) -> None:
    port = setup.router.port
    cmpl = {"model": MODEL, "prompt": "The for statement", "max_tokens": 16, "temperature": 0}
    _, _, whole = request(port, "/v1/completions", cmpl)
    events = _sse(port, "/v1/completions", cmpl | {"stream": True})
    assert events[-1] == "[DONE]" and len(events) > 3
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == json.loads(whole)["choices"][0]["text"]
    chat = chat_body("What does the pass statement do?")
    _, _, whole = request(port, "/v1/chat/completions", chat)
    events = _sse(port, "/v1/chat/completions", chat | {"stream": True})
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == json.loads(whole)["choices"][0]["message"]["content"]


def test_models_health_metrics_and_errors_pass_through(setup: Setup) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", setup.router.port, timeout=30)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert _health(setup.router.port) == 200
    status, _, raw = request(setup.router.port, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"  # not retried
    assert metric(setup.router.port, "kvtier:router_requests_total") >= 1
    status, _, raw = request(setup.router.port, "/v1/completions", {"prompt": "x" * (1 << 20)})
    assert status == 413 and "larger than 1048576 bytes" in json.loads(raw)["error"]["message"]


def _concurrently(port: int, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = request(port, path, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return [threads, results]


def test_a_replica_killed_mid_run_loses_no_request(setup: Setup) -> None:
    """Runs last in this module: it kills a replica once all three of its requests run. Each
    generates hundreds of tokens (ignore_eos), so none can finish between that check and the
    SIGKILL, however loaded the box: they fail over and the survivor serves all six."""
    path = "/v1/completions"
    victim, survivor = setup.replicas
    bodies: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for i in range(40):  # three prompts the victim owns and three the survivor owns
        body = {"model": MODEL, "prompt": f"Case {i}: the try statement", "max_tokens": 440}
        body |= {"temperature": 0, "ignore_eos": True}
        owned = bodies[setup.owner(path, body) == victim.url]
        if len(owned) < 3:
            owned.append(body)
    todo = bodies[True] + bodies[False]
    assert len(todo) == 6
    threads, results = _concurrently(setup.router.port, path, todo)
    for t in threads:
        t.join(300)
    expected = [json.loads(r[2])["choices"][0]["text"] for r in results]
    assert [r[1]["x-kvtier-replica"] for r in results] == [victim.url] * 3 + [survivor.url] * 3
    before = metric(setup.router.port, "kvtier:router_failovers_total")

    threads, results = _concurrently(setup.router.port, path, todo)
    wait_until(lambda: metric(victim.port, "vllm:num_requests_running") >= 3, 120)
    victim.proc.kill()  # SIGKILL mid-generation
    for t in threads:
        t.join(300)
    for i, r in enumerate(results):
        assert r is not None and r[0] == 200, r
        assert json.loads(r[2])["choices"][0]["text"] == expected[i]  # same greedy tokens
        assert r[1]["x-kvtier-replica"] == survivor.url
    assert metric(setup.router.port, "kvtier:router_failovers_total", victim.url) > before
    assert metric(setup.router.port, "kvtier:router_replica_up", victim.url) == 0
    assert _health(setup.router.port) == 200  # one replica is enough
