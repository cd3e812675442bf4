"""vLLM's metric families as kvtier exports them: a request's phases from its instants (vLLM's
queue, prefill, decode and inference split), the `model_name`/`engine` labels, vLLM's bucket
bounds, and `kvtier serve --metrics-prefix` renaming them while kvtier's own stay `kvtier:`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.server.metrics import EngineMetrics
from kvtier.server.vllm_metrics import MetricNames, RequestRecord, one_two_five_buckets
from tests.server.conftest import free_port, serve_command, serving
from tests.server.test_grafana_board import scrape

LABELS = {"model_name": "m", "engine": "0"}


def record(**kw: float | int | str | None) -> RequestRecord:
    base: dict[str, float | int | str | None] = dict(
        arrival=100.0, scheduled=101.0, first_token=103.0, last_token=107.0, finished=108.0,
        reason="length", num_prompt_tokens=30, num_generation_tokens=5, num_cached_tokens=16,
        num_external_cached_tokens=8, max_tokens=5,
    )  # fmt: skip
    return RequestRecord(**(base | kw))  # type: ignore[arg-type]


def value(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, LABELS | labels)


def test_a_finished_request_splits_into_vllms_phases() -> None:
    metrics = EngineMetrics(512, MetricNames("m", "llm"))
    metrics.finished(record())
    for name, seconds in (
        ("e2e_request_latency", 8.0),
        ("request_queue_time", 1.0),  # arrival → first scheduled
        ("request_prefill_time", 2.0),  # first scheduled → first token
        ("request_decode_time", 4.0),  # first token → last token
        ("request_inference_time", 6.0),  # first scheduled → last token
        ("request_time_per_output_token", 1.0),  # decode over the 4 tokens after the first
    ):
        assert value(metrics, f"llm:{name}_seconds_sum") == seconds, name
        assert value(metrics, f"llm:{name}_seconds_count") == 1, name
    assert value(metrics, "llm:request_success_total", finished_reason="length") == 1
    assert value(metrics, "llm:request_prompt_tokens_sum") == 30
    assert value(metrics, "llm:request_prefill_kv_computed_tokens_sum") == 14
    by_source = {"local_compute": 14, "local_cache_hit": 8, "external_kv_transfer": 8}
    for source, n in by_source.items():
        assert value(metrics, "llm:prompt_tokens_by_source_total", source=source) == n
    assert metrics.registry.get_sample_value("vllm:request_success_total", LABELS) is None


def test_a_request_aborted_in_the_queue_counts_no_phase() -> None:
    metrics = EngineMetrics(512, MetricNames("m"))
    metrics.finished(
        record(scheduled=None, first_token=None, last_token=None, reason="abort", max_tokens=None)
    )
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "vllm:request_queue_time_seconds_count") == 0
    assert value(metrics, "vllm:request_decode_time_seconds_count") == 0
    assert value(metrics, "vllm:request_params_max_tokens_count") == 0


def test_buckets_reach_as_far_as_vllms() -> None:
    """The issue's dashboard saw TTFT capped at 30 s and E2E at 120 s; vLLM's reach further."""
    metrics = EngineMetrics(2048, MetricNames("m"))
    top = {"vllm:time_to_first_token_seconds": 2560.0, "vllm:e2e_request_latency_seconds": 7680.0}
    for name, le in top.items():
        assert value(metrics, f"{name}_bucket", le=str(le)) == 0, name
    assert one_two_five_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert value(metrics, "vllm:request_prompt_tokens_bucket", le="2000.0") == 0
    assert value(metrics, "vllm:request_prompt_tokens_bucket", le="5000.0") is None


@pytest.mark.parametrize("prefix", ["kvtier", "bad-name", "1x"])
def test_a_bad_prefix_is_refused_naming_the_flag(prefix: str) -> None:
    with pytest.raises(ValueError, match="--metrics-prefix"):
        MetricNames("m", prefix)
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--metrics-prefix", prefix]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--metrics-prefix" in out.stderr


def test_serve_exports_vllms_families_under_the_chosen_prefix(tmp_path: Path) -> None:
    port = free_port()
    cmd = [*serve_command(port, 128, 32), "--metrics-prefix", "kvtier_vllm"]
    with serving(cmd, port, tmp_path / "serve.log"):
        names = {name: labels for name, labels in scrape(port)}
    want = {"model_name": "kvtier-default", "engine": "0"}
    assert names["kvtier_vllm:num_requests_running"] == want
    assert names["kvtier_vllm:kv_cache_usage_perc"] == want
    assert not any(n.startswith("vllm:") for n in names)
    assert names["kvtier:kv_cache_usage_perc"] == {"tier": "device"}
