"""Request lifecycle seen from outside: a client that disconnects mid-stream aborts its request
and its blocks come back (pool integrity checked on the engine thread); /metrics moves."""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.engine import EngineCore
from tests.server.conftest import (
    MODEL,
    VLLM,
    ServerHandle,
    _health,
    free_port,
    serve_command,
    serving,
    wait_until,
)


def _idle(server: ServerHandle) -> bool:
    return server.engine.call(
        lambda e: e.stats().num_requests == 0 and not e.has_unfinished_requests()
    )


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServerHandle) -> None:
    wait_until(lambda: _idle(server))
    aborted = ("vllm:request_success_total", tuple(sorted((*VLLM, ("finished_reason", "abort")))))
    before = server.metrics()[aborted]
    for path, body in [
        ("/v1/completions", {"prompt": "The while statement", "max_tokens": 450}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 450},
        ),
    ]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        payload = body | {"model": MODEL, "stream": True, "ignore_eos": True}
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for _ in range(3):  # a few tokens arrive, so the request holds blocks mid-decode
            assert resp.readline().startswith(b"data: ")
            resp.readline()
        assert server.engine.call(lambda e: e.stats().device.usage) > 0
        conn.close()
        wait_until(lambda: _idle(server))
    assert server.metrics()[aborted] == before + 2

    def check(engine: EngineCore) -> tuple[float, int, int]:
        engine.check_integrity()
        stats = engine.stats()
        return stats.device.usage, stats.device.num_quarantined_refs, stats.num_requests

    wait_until(lambda: server.engine.call(check)[1] == 0)  # quarantine drains at the next step
    usage, _, num_params = server.engine.call(check)
    assert usage == 0.0 and num_params == 0


def test_disconnect_while_waiting_for_a_whole_completion_aborts(server: ServerHandle) -> None:
    wait_until(lambda: _idle(server))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": "The def", "max_tokens": 450, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_until(lambda: server.engine.call(lambda e: e.stats().num_requests) == 1)
    conn.close()
    wait_until(lambda: _idle(server))
    server.engine.call(lambda e: e.check_integrity())


def test_metrics_move_as_requests_run(server: ServerHandle) -> None:
    before = server.metrics()
    out = server.client().completions.create(
        model=MODEL,
        prompt="The class statement",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()
    assert out.usage is not None

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    device = (("tier", "device"),)
    length = tuple(sorted((*VLLM, ("finished_reason", "length"))))
    assert moved("vllm:generation_tokens_total", VLLM) == 7
    assert moved("vllm:prompt_tokens_total", VLLM) == out.usage.prompt_tokens
    assert moved("kvtier:prefix_cache_queries_total", device) >= out.usage.prompt_tokens
    assert moved("vllm:prefix_cache_queries_total", VLLM) >= out.usage.prompt_tokens
    assert moved("vllm:request_success_total", length) == 1
    assert moved("vllm:request_prompt_tokens_sum", VLLM) == out.usage.prompt_tokens
    assert moved("vllm:request_generation_tokens_sum", VLLM) == 7
    assert moved("vllm:request_params_max_tokens_sum", VLLM) == 7
    for name in (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "request_inference_time",
        "request_time_per_output_token",
    ):
        assert moved(f"vllm:{name}_seconds_count", VLLM) == 1, name
    assert moved("vllm:inter_token_latency_seconds_count", VLLM) >= 1
    assert moved("vllm:iteration_tokens_total_count", VLLM) >= 1
    assert after[("kvtier:kv_cache_num_blocks", device)] == 511
    for name in (
        "kvtier:kv_cache_usage_perc",
        "kvtier:prefix_cache_hits_total",
    ):
        assert (name, device) in after
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
    ):
        assert (name, VLLM) in after
    for name in (
        "kvtier:kv_quarantined_block_refs",
        "kvtier:kv_pending_transfers",
    ):
        assert (name, ()) in after
    assert after[("kvtier:sanitizer_hazards_total", (("kind", "RAW"),))] == 0
    assert after[("kvtier:kv_transfer_bytes_total", (("direction", "device_to_host"),))] == 0


def test_serve_cli_lists_the_vllm_style_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--max-waiting-requests",
        "--max-request-body-bytes",
        "--max-model-len",
        "--max-num-seqs",
        "--block-size",
        "--enable-prefix-caching",
        "--kv-offloading-size",
        "--protect",
        "--num-device-blocks",
        "--num-speculative-tokens",
    ):
        assert flag in out, flag


def test_kvtier_serve_starts_logs_the_kv_layout_and_answers(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with serving(serve_command(port, 256, 64), port, log, 60):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"model": MODEL, "prompt": "The with statement", "max_tokens": 4}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = json.loads(conn.getresponse().read())
        conn.close()
        assert reply["usage"]["completion_tokens"] == 4
    text = log.read_text()
    assert "KV layout: 3 groups [FullAttention layers [2, 5]; SlidingWindow(window=64)" in text
    assert "device 64 blocks × 8192 B" in text


def test_cancelled_whole_completion_logs_no_traceback(
    server: ServerHandle, caplog: pytest.LogCaptureFixture
) -> None:
    wait_until(lambda: _idle(server))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            body = {"model": MODEL, "prompt": "The def", "max_tokens": 450, "ignore_eos": True}
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            wait_until(lambda: server.engine.call(lambda e: e.stats().num_requests) == 1)
            conn.close()
            wait_until(lambda: _idle(server))
        # the handler finishes after the abort; a health check afterwards orders the log after it
        assert _health(server.port) == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
