"""Scale-out as docs/serving.md, Scale-out sets it up, all real processes: a redis-server, two
`kvtier serve` replicas sharing it as their remote tier with their KV events on, and vllm-router in
front (one round_robin router, and one kv_aware router subscribed to the replicas' events). Replica B's first request
on A's prefix is a remote hit; a returning conversation goes back to the replica that holds it (the
router's own decision counters say which); a SIGSTOPped replica's requests complete on the other;
a client that disconnects through the router is aborted on the replica (its blocks come back);
Redis killed mid-run loses no request. sglang-router works in front of the same replicas with the
bodies it rewrites."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.procs import Proc, free_port, spawn, stop
from tests.server.conftest import MODEL, wait_until
from tests.server.procs import _start, binary, metric, request, start_vllm_router, wait_ready
from tests.stores.servers import RedisServer

SERVE = ["serve", "--max-model-len", "1024", "--num-device-blocks", "512", "--torch-threads", "1"]
TIERED = ["--num-host-blocks", "64", "--kv-tier-timeout-s", "5"]
# A request still unanswered after this long is given up on and retried on the other replica:
# what frees the requests of a hung replica (its TCP socket still accepts). Far above a request
# of these tests, so only a stopped replica reaches it.
REQUEST_TIMEOUT_S = 20
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router's log colours
SYSTEM = (
    "You are a careful assistant for a library of Python recipes. Answer in one sentence, cite "
    "the recipe by its number, and never invent a recipe that is not listed below. Recipes: 1. "
    "read a file line by line; 2. parse JSON from a string; 3. sort a list of dicts by a key; 4. "
    "time a function; 5. walk a folder tree; 6. retry a flaky call; 7. format a date. "
)


@dataclass
class Router:
    proc: Proc
    metrics_port: int
    policy: str

    @property
    def port(self) -> int:
        return self.proc.port

    def decisions(self, worker: Proc) -> float:
        """Requests the router's policy sent to `worker`: its decision counter, or for kv_aware,
        which counts none per worker, its debug log's decision lines."""
        if self.policy == "kv_aware":
            text = ANSI.sub("", self.proc.log.read_text(errors="replace"))
            line = f'KV prefix decision outcome="prefix_cost" worker="{worker.url}"'
            return float(text.count(line))
        labels = f'policy="{self.policy}",worker="{worker.url}"'
        return metric(self.metrics_port, "vllm_router_policy_decisions_total", labels)

    def health(self, worker: Proc) -> float:
        labels = f'worker="{worker.url}"'
        return metric(self.metrics_port, "vllm_router_worker_health", labels)


@dataclass
class Setup:
    redis: RedisServer
    replicas: list[Proc]
    rr: Router  # round_robin: alternates, so a prefix meets the other replica
    affine: Router  # kv_aware over the replicas' KV events, the policy docs/serving.md recommends

    def served_by(self, router: Router, path: str, body: dict[str, Any]) -> tuple[Proc, Any]:
        """Send `body` through `router` alone and read which replica its policy chose."""
        before = [router.decisions(r) for r in self.replicas]
        status, _, raw = request(router.port, path, body)
        assert status == 200, raw
        after = [router.decisions(r) for r in self.replicas]
        chosen = [r for r, b, a in zip(self.replicas, before, after) if a > b]
        assert len(chosen) == 1, (before, after)
        return chosen[0], json.loads(raw)


def _router(policy: str, replicas: list[Proc], log: Path, *flags: str) -> Router:
    proc, metrics_port = start_vllm_router(replicas, log, "--policy", policy, *flags)
    return Router(proc, metrics_port, policy)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("vllm_router")
    redis = RedisServer(folder / "redis").start()
    flags = [*SERVE, *TIERED, "--kv-remote-url", redis.url]
    ports = [free_port() for _ in range(2)]
    replicas = [
        _start([*flags, "--kv-events-config", events_config(port)], folder / f"replica{i}.log")
        for i, port in enumerate(ports)
    ]
    routers: list[Router] = []
    try:
        wait_ready(replicas)
        timeout = ["--request-timeout-secs", str(REQUEST_TIMEOUT_S)]
        routers.append(_router("round_robin", replicas, folder / "rr.log", *timeout))
        sources = ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        for replica, port in zip(replicas, ports):
            sources += ["--kv-event-source", f"{replica.url}=tcp://127.0.0.1:{port}"]
        sources += ["--log-level", "debug"]  # its decisions are in its log
        affine = _router("kv_aware", replicas, folder / "affine.log", *timeout, *sources)
        routers.append(affine)
        for router in routers:
            wait_ready([router.proc], 120)
            wait_until(lambda router=router: all(router.health(r) == 1 for r in replicas), 60)  # type: ignore[misc]
        yield Setup(redis, replicas, *routers)
    finally:
        stop([r.proc for r in routers] + replicas)
        redis.stop()


def events_config(port: int) -> str:
    """vLLM's `--kv-events-config`: the replica's KV events on a PUB socket the router's
    subscriber connects to (a wildcard host binds, as vLLM's publisher does)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return json.dumps(config)


def chat(*turns: str, system: str | None = SYSTEM) -> dict[str, Any]:
    roles = ["user", "assistant"] * len(turns)
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": r, "content": c} for r, c in zip(roles, turns)]
    return {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0}


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_other_replica_finds_a_prefix_in_redis(setup: Setup) -> None:
    """round_robin sends two conversations on one system prompt to different replicas: the
    second's prompt is a remote hit on its replica, counted in usage and on /metrics."""
    path = "/v1/chat/completions"
    first_replica, first = setup.served_by(setup.rr, path, chat("Which recipe sorts records?"))
    assert cached(first) == 0
    demoted = 'op="demoted",tier="remote"'
    wait_until(lambda: metric(first_replica.port, "kvtier:kv_tier_blocks_total", demoted) > 0, 60)
    with setup.redis.client() as c:  # the demotions are written (puts are background)
        queued = metric(first_replica.port, "kvtier:kv_tier_blocks_total", demoted)
        wait_until(lambda: c.dbsize() >= queued, 60)
    remote_hits = 'tier="remote"'
    second_replica = next(r for r in setup.replicas if r is not first_replica)
    hits_before = metric(second_replica.port, "kvtier:prefix_cache_hits_total", remote_hits)
    replica, second = setup.served_by(setup.rr, path, chat("Which recipe walks a folder?"))
    assert replica is second_replica
    assert cached(second) > 0
    hits = metric(replica.port, "kvtier:prefix_cache_hits_total", remote_hits) - hits_before
    assert hits == cached(second)


def _hold(setup: Setup, path: str, body: dict[str, Any]) -> tuple[Proc, threading.Thread]:
    """Start a long request through the prefix-aware router and return the replica it chose
    while the request still runs there."""
    body = body | {"max_tokens": 600, "ignore_eos": True}  # fits max_model_len
    before = [setup.affine.decisions(r) for r in setup.replicas]
    thread = threading.Thread(target=request, args=(setup.affine.port, path, body))
    thread.start()
    wait_until(lambda: sum(setup.affine.decisions(r) for r in setup.replicas) > sum(before), 60)
    chosen = [r for r, b in zip(setup.replicas, before) if setup.affine.decisions(r) > b]
    wait_until(lambda: metric(chosen[0].port, "vllm:num_requests_running") >= 1, 60)
    return chosen[0], thread


def question_of(topic: str) -> str:
    """Conversations that share no prefix (a shared system prompt would draw every one of them
    to the replica that served the first: cache_aware follows its longest text match)."""
    return f"{topic.capitalize()}: what does this Python statement do, in short?"


def test_a_returning_conversation_goes_back_to_its_replica(setup: Setup) -> None:
    """Conversations start on both replicas: while a long request holds one replica, the policy
    sends new prefixes to the other; the second holder continues a conversation of the first
    group, so it follows that group by prefix and the second group starts on the first holder's
    replica. Each conversation's next turn, through the same router, lands where its first
    turn ran (the router's decision counters) and hits that replica's prefix cache."""
    path = "/v1/chat/completions"
    homes: dict[str, tuple[Proc, str]] = {}
    held: list[Proc] = []
    for group in (["import", "while", "class"], ["with", "return", "yield"]):
        if not held:
            body = {"model": MODEL, "prompt": "Hold: the pass statement does nothing. " * 10}
            busy, thread = _hold(setup, "/v1/completions", body)
        else:
            turns = question_of("import"), homes["import"][1], "Hold."
            busy, thread = _hold(setup, path, chat(*turns, system=None))
        held.append(busy)
        for topic in group:
            home, resp = setup.served_by(setup.affine, path, chat(question_of(topic), system=None))
            assert home is not busy
            homes[topic] = home, resp["choices"][0]["message"]["content"]
        thread.join(300)
    assert held[0] is not held[1]  # so the conversations started on both replicas
    for topic, (home, reply) in homes.items():
        turns = question_of(topic), reply, "Example?"
        replica, resp = setup.served_by(setup.affine, path, chat(*turns, system=None))
        assert replica is home
        assert cached(resp) >= 16  # at least one block of the conversation was still there


def _stream_and_hang_up(port: int, body: dict[str, Any]) -> None:
    """Post a streaming request, read its first event, then close the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    sock.close()


def _post_and_hang_up(port: int, body: dict[str, Any], replica: Proc) -> None:
    """Post a non-streaming request and close the connection while it runs, before any byte
    of the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_until(lambda: metric(replica.port, "vllm:num_requests_running") >= 1, 120)
    conn.close()


def in_flight(replica: Proc) -> float:
    """Requests the replica holds: running, or waiting for blocks."""
    running = metric(replica.port, "vllm:num_requests_running")
    return running + metric(replica.port, "vllm:num_requests_waiting")


def _idle(replica: Proc) -> bool:
    return (
        metric(replica.port, "vllm:num_requests_running") == 0
        and metric(replica.port, "kvtier:kv_cache_usage_perc", 'tier="device"') == 0
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_through_the_router_is_aborted(setup: Setup, stream: bool) -> None:
    """The request would generate ~1000 tokens; the client leaves after the first event (or
    before any byte): the replica aborts it and every block it held is free again."""
    body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 1000}
    body |= {"ignore_eos": True, "temperature": 0, "stream": stream}
    # the round_robin router's next pick: the replica with fewer decisions so far
    replica = min(setup.replicas, key=setup.rr.decisions)
    aborted = 'finished_reason="abort"'
    before = [metric(r.port, "vllm:request_success_total", aborted) for r in setup.replicas]
    if stream:
        _stream_and_hang_up(setup.rr.port, body)
    else:
        _post_and_hang_up(setup.rr.port, body, replica)
    wait_until(
        lambda: (
            [metric(r.port, "vllm:request_success_total", aborted) for r in setup.replicas]
            != before
        ),
        120,
    )
    after = [metric(r.port, "vllm:request_success_total", aborted) for r in setup.replicas]
    assert sum(after) - sum(before) == 1
    for r in setup.replicas:
        wait_until(lambda r=r: _idle(r), 120)  # type: ignore[misc]


def _sse_text(port: int, path: str, body: dict[str, Any]) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", raw
    choices = [json.loads(e)["choices"] for e in events[:-1]]
    key = "delta" if path.endswith("chat/completions") else None
    return "".join(
        (c[0]["delta"].get("content") or "") if key else c[0]["text"] for c in choices if c
    )


def _answer(port: int, path: str, body: dict[str, Any]) -> str:
    status, _, raw = request(port, path, body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_sglang_router_fronts_the_replicas_with_its_own_bodies(
    setup: Setup, tmp_path: Path
) -> None:
    """sglang-router re-serialises each request with SGLang's fields written out (for chat
    `separate_reasoning`, `stream_reasoning`, `no_stop_trim`, `return_hidden_states`, …):
    completions and chat, whole and streamed, come back with the tokens a replica gives
    directly, and the replica logged SGLang's fields as ignored, so those were its bodies."""
    port = free_port()
    cmd = [binary("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *[r.url for r in setup.replicas], "--policy", "cache_aware"]
    cmd += ["--prometheus-port", str(free_port()), "--health-check-interval-secs", "1"]
    router = spawn(cmd, tmp_path / "sglang.log", port)
    try:
        wait_ready([router], 120)
        cmpl = {"model": MODEL, "prompt": "The while statement", "max_tokens": 12}
        cmpl |= {"temperature": 0}
        talk = chat("Which recipe retries a call?") | {"max_tokens": 12}
        direct = setup.replicas[0].port
        for path, body in (("/v1/completions", cmpl), ("/v1/chat/completions", talk)):
            expected = _answer(direct, path, body)
            assert _answer(port, path, body) == expected
            assert _sse_text(port, path, body) == expected
    finally:
        stop([router])
    logs = "".join(r.log.read_text() for r in setup.replicas)
    assert "request field 'separate_reasoning' is not used by this server" in logs


def _concurrently(port: int, path: str, bodies: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    results: list[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = request(port, path, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, results


def _long_bodies(n: int, tag: str) -> list[dict[str, Any]]:
    return [
        {"model": MODEL, "prompt": f"{tag} {i}: the try statement", "max_tokens": 300}
        | {"temperature": 0, "ignore_eos": True}
        for i in range(n)
    ]


def _texts(results: list[Any]) -> list[str]:
    for r in results:
        assert r is not None and r[0] == 200, r
    return [json.loads(r[2])["choices"][0]["text"] for r in results]


def test_a_stopped_replica_s_requests_complete_on_the_other(setup: Setup) -> None:
    """The whole replica (HTTP and engine processes) is SIGSTOPped while it runs requests: the
    router's health check drops it within seconds, and the requests it held are given up after
    `--request-timeout-secs` and retried on the other replica; all complete with the same
    greedy tokens. After SIGCONT the stopped replica aborts what the router gave up on."""
    bodies = _long_bodies(4, "Stop")
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    for t in threads:
        t.join(300)
    expected = _texts(results)
    victim = setup.replicas[0]
    aborted = 'finished_reason="abort"'
    aborts_before = metric(victim.port, "vllm:request_success_total", aborted)
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    wait_until(lambda: metric(victim.port, "vllm:num_requests_running") >= 1, 120)
    victim.signal_all(signal.SIGSTOP)
    try:
        wait_until(lambda: setup.rr.health(victim) == 0, 60)  # out of the rotation
        for t in threads:
            t.join(300)
        assert _texts(results) == expected
    finally:
        victim.signal_all(signal.SIGCONT)
    wait_until(
        lambda: metric(victim.port, "vllm:request_success_total", aborted) > aborts_before, 60
    )
    wait_until(lambda: _idle(victim), 60)
    wait_until(lambda: setup.rr.health(victim) == 1, 60)  # and back in


def test_redis_killed_mid_run_loses_no_request(setup: Setup) -> None:
    """Runs last (it kills the module's Redis). Both replicas are generating when Redis is
    SIGKILLed; every request completes with the tokens it had with Redis up."""
    bodies = _long_bodies(4, "Redis")
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    for t in threads:
        t.join(300)
    expected = _texts(results)
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    for r in setup.replicas:
        wait_until(lambda r=r: metric(r.port, "vllm:num_requests_running") >= 1, 120)  # type: ignore[misc]
    setup.redis.kill()
    for t in threads:
        t.join(300)
    assert _texts(results) == expected
    # new prompts after the loss: looked up in a dead Redis, answered all the same
    fresh = _long_bodies(2, "After")
    threads, results = _concurrently(setup.rr.port, "/v1/completions", fresh)
    for t in threads:
        t.join(300)
    _texts(results)
    assert (
        sum(metric(r.port, "kvtier:kv_tier_errors_total", 'tier="remote"') for r in setup.replicas)
        > 0
    )


def test_a_replica_killed_mid_run(setup: Setup) -> None:
    """Runs last (it kills a replica). A stream is running on one replica with two whole
    requests beside it when that replica is SIGKILLed: the whole requests are retried on the
    other replica and complete with the same greedy tokens; the stream, which had sent tokens
    already, ends without its `[DONE]` (the client knows it was cut)."""
    bodies = _long_bodies(4, "Kill")
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    for t in threads:
        t.join(300)
    expected = _texts(results)
    body = {"model": MODEL, "prompt": "The del statement", "max_tokens": 900, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", setup.rr.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b"data: ")

    def running() -> list[Proc]:
        return [r for r in setup.replicas if metric(r.port, "vllm:num_requests_running") >= 1]

    # the gauge is set after the step's tokens are sent, so the first line can come before it
    wait_until(lambda: bool(running()), 120)
    (victim,) = running()
    threads, results = _concurrently(setup.rr.port, "/v1/completions", bodies)
    wait_until(lambda: in_flight(victim) >= 3, 120)
    victim.signal_all(signal.SIGKILL)
    rest = b""
    try:
        rest = stream.read()
    except http.client.IncompleteRead as exc:  # the chunked body stops mid-way
        rest = exc.partial
    conn.close()
    assert b"data: [DONE]" not in rest
    for t in threads:
        t.join(300)
    assert _texts(results) == expected
    wait_until(lambda: setup.rr.health(victim) == 0, 60)
