"""The console script end to end: `kvtier plan` and `kvtier bench kv` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_plan_default_model_prints_tiers_and_saves_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = kvtier("plan", "--max-model-len", "8192", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "tier device" in r.stdout and "max concurrency at max length" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["architecture"] == "Gemma3ForCausalLM"
    assert plan["tiers"][0]["max_concurrency_at_max_len"] > 0
    assert len(plan["groups"]) == 7


def test_plan_refuses_impossible_configuration_with_flag() -> None:
    r = kvtier("plan", "--num-device-blocks", "50")
    assert r.returncode == 2
    assert "--num-device-blocks" in r.stderr and "Traceback" not in r.stderr


def test_plan_rejects_bad_size_flag() -> None:
    r = kvtier("plan", "--kv-cache-memory-bytes", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr


def test_bench_kv_saves_json(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    r = kvtier(
        "bench",
        "kv",
        "--num-blocks",
        "5000",
        "--prompt-len",
        "512",
        "--iters",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["manager"]["full/sha256"]["lookup_miss_plus_allocate_us"] > 0
    assert data["manager"]["full/xxhash"]["hit_rate"] > 0.4
