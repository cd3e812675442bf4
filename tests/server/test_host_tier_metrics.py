"""Host-tier series of the server's metrics, fed from an engine that offloads (in process)."""

from __future__ import annotations

import random

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.model.testing import write_tiny_model
from kvtier.server.metrics import EngineMetrics


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_transfer_bytes_and_host_prefix_hits_move(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write_tiny_model(tmp_path / "m", "gemma3", window=8)
    args = EngineArgs.from_kwargs(
        str(path), max_model_len=64, block_size=4, num_device_blocks=80, num_host_blocks=400
    )
    engine = EngineCore(args)
    metrics = EngineMetrics(engine.plan.max_model_len)
    metrics.set_layout(engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(30)] for _ in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for rnd in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{rnd}-{i}", p, params)
        engine.drain()
        metrics.update(engine.stats())
    got = samples(metrics)
    assert got[("kvtier:kv_cache_num_blocks", (("tier", "host"),))] == 399
    assert got[("kvtier:kv_transfer_bytes_total", (("direction", "device_to_host"),))] > 0
    assert got[("kvtier:kv_transfer_bytes_total", (("direction", "host_to_device"),))] > 0
    assert got[("kvtier:prefix_cache_hits_total", (("tier", "host"),))] > 0
    assert got[("kvtier:kv_pending_transfers", ())] == 0
