"""The Grafana board we ship (`examples/grafana/kvtier-vllm.json`, its panels on the PromQL of
vLLM's example board) against a real `kvtier serve` with host and disk tiers, after completions,
chat and streamed requests: every series selector of every query (parsed by promql-parser) has
samples on /metrics, and a real Prometheus (Debian's `prometheus`) scraping the server returns
data for every query, finite numbers for the latency panels."""

from __future__ import annotations

import http.client
import json
import math
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import free_port, serving, wait_until

BOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvtier-vllm.json"
NAME = "board-model"  # a served name other than the default: model_name must follow it
RATE_INTERVAL = "10m"  # Grafana's $__rate_interval: wide enough to hold every scrape of the test
Sample = tuple[str, dict[str, str]]
LATENCY_PANELS = {
    "E2E request latency",
    "Time to first token",
    "Inter-token latency",
    "Time per output token",
    "Request time per output token",
}


def board_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, the dashboard variables filled in."""
    board = json.loads(BOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$model_name", NAME)
            out.append((panel["title"], expr.replace("$__rate_interval", RATE_INTERVAL)))
    return out


def selectors(node: Any) -> Iterator[promql_parser.VectorSelector]:
    """Every series selector in a parsed PromQL expression (those of range selectors included)."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node
        return
    for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
        child = getattr(node, attr, None)
        if child is not None:
            yield from selectors(child)
    for arg in getattr(node, "args", None) or []:
        yield from selectors(arg)


def matches(selector: promql_parser.VectorSelector, samples: list[Sample]) -> bool:
    """True if a sample has the selector's name and satisfies all its label matchers."""
    tests = []
    for m in selector.matchers.matchers:
        op = str(m.op).rsplit(".", 1)[-1]
        tests.append((m.name, op, m.value))

    def ok(labels: dict[str, str]) -> bool:
        for name, op, value in tests:
            got = labels.get(name, "")
            hit = got == value if op in ("Equal", "NotEqual") else bool(re.fullmatch(value, got))
            if hit != (op in ("Equal", "Re")):
                return False
        return True

    return any(name == selector.name and ok(labels) for name, labels in samples)


def missing_series(exprs: list[tuple[str, str]], samples: list[Sample]) -> list[str]:
    return [
        f"{title}: {expr} needs {sel.prettify()}"
        for title, expr in exprs
        for sel in selectors(promql_parser.parse(expr))
        if not matches(sel, samples)
    ]


def scrape(port: int) -> list[Sample]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return [(s.name, s.labels) for f in text_string_to_metric_families(text) for s in f.samples]


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    port: int

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", f"/api/v1/query?{q}")
        body = json.loads(conn.getresponse().read())
        conn.close()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else -1.0


def start_prometheus(tmp: Path, target_port: int) -> Prometheus:
    exe = shutil.which("prometheus")
    assert exe is not None
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: kvtier\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    cmd = [
        exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    prom = Prometheus(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port)
    # its first scrape of the server: the requests below then move counters between two samples
    wait_until(lambda: _prom_up(prom), 60)
    return prom


def _prom_up(prom: Prometheus) -> bool:
    assert prom.proc.poll() is None, "prometheus exited; see prometheus.log"
    try:
        return prom.scalar('up{job="kvtier"}') == 1.0
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return False


@dataclass
class Setup:
    port: int
    num_requests: int
    prometheus: Prometheus | None


def send_traffic(port: int) -> int:
    """Completions and chat, whole and streamed, a repeated prompt (a prefix hit); the count."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = "The with statement wraps a block in the methods of a context manager, and"
    chat = [{"role": "user", "content": "Name a Python keyword."}]
    n = 0
    for stream in (False, True):
        for _ in range(2):
            out = client.completions.create(
                model=NAME, prompt=prompt, max_tokens=6, temperature=0, stream=stream
            )
            if stream:
                list(out)  # type: ignore[call-overload]
            n += 1
        reply = client.chat.completions.create(
            model=NAME,
            messages=chat,
            max_tokens=5,
            stream=stream,  # type: ignore[arg-type]
        )
        if stream:
            list(reply)  # type: ignore[call-overload]
        n += 1
    return n


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("board")
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port),
        "--served-model-name", NAME, "--max-model-len", "256", "--num-device-blocks", "64",
        "--num-host-blocks", "64", "--kv-disk-path", str(tmp / "disk"), "--torch-threads", "1",
    ]  # fmt: skip
    prom: Prometheus | None = None
    with serving(cmd, port, tmp / "serve.log"):
        try:
            if shutil.which("prometheus"):
                prom = start_prometheus(tmp, port)
            n = send_traffic(port)
            yield Setup(port, n, prom)
        finally:
            if prom is not None:
                prom.proc.terminate()
                prom.proc.wait(30)


def test_every_query_of_the_board_has_series(setup: Setup) -> None:
    queries = board_queries()
    assert len(queries) >= 40
    assert missing_series(queries, scrape(setup.port)) == []


def test_the_selector_check_catches_a_missing_name_or_label(setup: Setup) -> None:
    samples = scrape(setup.port)
    good = f'rate(vllm:generation_tokens_total{{model_name="{NAME}"}}[1m])'
    assert missing_series([("ok", good)], samples) == []
    for bad in (
        'rate(vllm:generation_tokens_total{model_name="another-model"}[1m])',
        f'histogram_quantile(0.5, rate(vllm:no_such_family_bucket{{model_name="{NAME}"}}[1m]))',
        'vllm:num_requests_running{model_name!~".*"}',
        "kvtier:num_requests_running",  # vLLM's families moved to the vllm: prefix
    ):
        assert len(missing_series([("bad", bad)], samples)) == 1, bad


@pytest.mark.skipif(not shutil.which("prometheus"), reason="needs Debian's prometheus on PATH")
def test_prometheus_returns_data_for_every_query(setup: Setup) -> None:
    prom = setup.prometheus
    assert prom is not None
    done = f'sum(vllm:request_success_total{{model_name="{NAME}"}})'
    # scraped after the last request finished, and once more (rate needs the final increase)
    wait_until(lambda: prom.scalar(done) >= setup.num_requests, 60)
    first = prom.scalar(f'timestamp(vllm:num_requests_running{{model_name="{NAME}"}})')
    wait_until(
        lambda: prom.scalar(f'timestamp(vllm:num_requests_running{{model_name="{NAME}"}})') > first,
        60,
    )
    empty, not_finite = [], []
    for title, expr in board_queries():
        result = prom.query(expr)
        if not result:
            empty.append(f"{title}: {expr}")
        values = [float(r["value"][1]) for r in result]
        if title in LATENCY_PANELS and not any(math.isfinite(v) for v in values):
            not_finite.append(f"{title}: {expr} = {values}")
    assert empty == []
    assert not_finite == []
