"""`kvtier bench offload` end to end on a tiny workload whose working set exceeds the device pool:
with the host tier on, later rounds load their history from the host (host hits, loads and stores),
with it off nothing does; greedy tokens are the same either way; the JSON has every column."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli import main


def test_offload_bench_host_tier_off_vs_on(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    rc = main(
        [
            "bench", "offload", "--num-prefixes", "2", "--prefix-len", "128",
            "--users-per-prefix", "8", "--rounds", "2", "--question-len", "32",
            "--answer-len", "8", "--concurrency", "4", "--store-modes", "eager",
            "--out", str(out), "--plot", str(tmp_path / "offload.png"),
        ]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    work = result["workload"]
    assert work["requests"] == 32 and work["device_blocks"] < work["working_set_blocks"]
    rows = {r["config"]: r for r in result["rows"]}
    off, on = rows["off"], rows["on-eager"]
    for row in (off, on):
        assert row["requests"] == 32 and row["output_tokens"] == 32 * 8
        assert row["same_tokens_as_off"] == 32  # greedy: the tier changes no token
        assert row["hazards"] == 0
        assert sum(row["hit_tokens"].values()) == row["prompt_tokens"]
        assert abs(sum(row["hit_fraction"].values()) - 1.0) < 1e-9
        for clock in ("ttft_device_ms", "ttft_wall_ms"):
            assert 0 < row[clock]["median"] <= row[clock]["p99"]
        assert row["tok_s_device"] > 0 and row["tok_s_wall"] > 0
        assert [r["round"] for r in row["by_round"]] == [0, 1]
    assert off["hit_tokens"]["host"] == 0 and off["host_loads"]["blocks"] == 0
    assert off["host_blocks"] == 0 and off["host_stores"]["blocks"] == 0
    assert on["hit_tokens"]["host"] > 0 and on["host_loads"]["blocks"] > 0
    assert on["host_stores"]["bytes"] > 0 and on["host_loads"]["failed"] == 0
    assert on["hit_tokens"]["recompute"] < off["hit_tokens"]["recompute"]
    ratios = result["ratios"]["on-eager"]
    assert set(ratios) >= {"ttft_device_mean_off_over_on", "tok_s_device_on_over_off"}
    assert (tmp_path / "offload.png").stat().st_size > 0


def test_offload_bench_one_line_per_tier_with_disk_and_redis(tmp_path: Path) -> None:
    """--tiers device,host,disk,remote: each configuration adds a tier; with a host tier a
    quarter of the workload and a disk half of it, the disk and the remote tier both serve
    prompt tokens, and every configuration gives the device-only tokens."""
    from tests.stores.servers import RedisServer

    redis_server = RedisServer(tmp_path / "redis").start()
    out = tmp_path / "tiers.json"
    try:
        rc = main(
            [
                "bench", "offload", "--tiers", "device,host,disk,remote",
                "--remote-url", redis_server.url, "--disk-fraction", "0.5",
                "--num-prefixes", "2", "--prefix-len", "128", "--users-per-prefix", "8",
                "--rounds", "3", "--question-len", "32", "--answer-len", "8",
                "--concurrency", "4", "--out", str(out),
            ]
        )  # fmt: skip
    finally:
        redis_server.stop()
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["device", "+host", "+disk", "+remote"]
    for row in rows.values():
        assert row["same_tokens_as_off"] == 48 and row["hazards"] == 0
        assert sum(row["hit_tokens"].values()) == row["prompt_tokens"]
    assert rows["+disk"]["hit_tokens"]["disk"] > 0
    assert rows["+remote"]["hit_tokens"]["remote"] > 0
    assert rows["+remote"]["lower_tiers"]["remote"]["demoted_blocks"] > 0
    assert "disk" not in rows["+host"]["hit_tokens"]


def test_offload_bench_8bit_kv_at_equal_tier_bytes(tmp_path: Path) -> None:
    """--kv-cache-dtypes bfloat16,fp8: each tier keeps its bytes, so the fp8 run's device pool
    and host tier hold twice the blocks, and more of the prompts are served from them (fewer
    recomputed) than at bfloat16; within each dtype every tier gives the device-only tokens."""
    out = tmp_path / "kv8.json"
    rc = main(
        [
            "bench", "offload", "--tiers", "device,host", "--dtype", "bfloat16",
            "--kv-cache-dtypes", "bfloat16,fp8", "--device-fraction", "0.3",
            "--num-prefixes", "4", "--prefix-len", "128", "--users-per-prefix", "6",
            "--rounds", "2", "--question-len", "32", "--answer-len", "4",
            "--concurrency", "2", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["bfloat16 device", "bfloat16 +host", "fp8 device", "fp8 +host"]
    block = result["kv_block_bytes"]
    assert block["bfloat16"] == 2 * block["fp8"]
    for tier in ("device", "host"):
        bf16, fp8 = rows["bfloat16 +host"][f"{tier}_blocks"], rows["fp8 +host"][f"{tier}_blocks"]
        assert 2 * bf16 - 1 <= fp8 <= 2 * bf16, (tier, bf16, fp8)
    for row in rows.values():
        assert row["same_tokens_as_off"] == 48 and row["hazards"] == 0
    recompute = {d: rows[f"{d} +host"]["hit_tokens"]["recompute"] for d in ("bfloat16", "fp8")}
    assert recompute["fp8"] < recompute["bfloat16"]
