"""The native kernel pool's counters (pool.c's rule that helpers must pay) reach an engine's
snapshot and the server's Prometheus families: calls with helpers, calls run alone, spells alone,
each advanced by what the process's counters moved."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.engine import LLM
from kvtier.model import native
from kvtier.server.metrics import EngineMetrics
from tests.model.test_native_pool import _norm


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
def test_the_kernel_pool_counters_reach_the_snapshot_and_the_metrics() -> None:
    llm = LLM(None, max_model_len=64, num_device_blocks=16)
    try:
        before = llm.engine.stats().kernel_pool
        assert set(before) == {"with_helpers", "alone", "spells_alone"}
        _norm(2)  # past the norm's threshold for helpers, on two threads
        stats = llm.engine.stats()
    finally:
        llm.engine.close()
    used = stats.kernel_pool["with_helpers"] + stats.kernel_pool["alone"]
    assert used > before["with_helpers"] + before["alone"]

    metrics = EngineMetrics(64)
    metrics.update(stats)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    calls = "kvtier:kernel_pool_calls_total"
    assert value(calls, mode="with_helpers") == stats.kernel_pool["with_helpers"]
    assert value(calls, mode="alone") == stats.kernel_pool["alone"]
    spells = "kvtier:kernel_pool_spells_alone_total"
    assert value(spells) == stats.kernel_pool["spells_alone"]
    # counters advance by what moved between snapshots
    later = {k: v + d for (k, v), d in zip(stats.kernel_pool.items(), (5, 3, 1), strict=True)}
    metrics.update(replace(stats, kernel_pool=later))
    assert value(calls, mode="with_helpers") == later["with_helpers"]
    assert value(calls, mode="alone") == later["alone"]
    assert value(spells) == later["spells_alone"]
