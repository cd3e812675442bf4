"""`kvtier bench sched` runs end to end on a small shape and writes the documented JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main


def test_bench_sched_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench_sched.json"
    argv = ["bench", "sched", "--num-requests", "8", "--prompt-len", "40", "--output-len", "6"]
    argv += ["--num-blocks", "256", "--window", "24", "--max-num-batched-tokens", "64"]
    argv += ["--repeat", "2", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert {(r["spec"], r["mode"]) for r in results} == {
        (s, m) for s in ("full", "swa", "hybrid") for m in ("sync", "async")
    }
    for r in results:
        assert r["num_requests"] == 8 and r["num_runs"] == 2
        for phase in ("prefill", "decode"):
            assert r[phase]["num_steps"] > 0
            assert r[phase]["median_us_per_request_step"] > 0
    assert "hybrid" in capsys.readouterr().out


def test_bench_sched_rejects_an_unknown_spec_family(tmp_path: Path) -> None:
    argv = ["bench", "sched", "--specs", "mla", "--out", str(tmp_path / "x.json")]
    assert main(argv) == 2
