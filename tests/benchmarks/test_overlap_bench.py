"""`kvtier bench overlap` at toy size: one row per async depth from real runs of the threaded cpu
backend, the same tokens at every depth, and its per-step split of time adding up."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import main, overlap


def test_overlap_bench_reports_every_depth_with_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    argv = ["--model", "tiny-llama", "--dtype", "float32", "--num-prompts", "4"]
    argv += ["--input-len", "16", "--output-len", "8", "--rounds", "1", "--out", str(out)]
    assert main(overlap, argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["async_depth"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["same_tokens_as_depth_1"] is True
        assert r["steps"] >= 8 and r["output_tok_s"] > 0
        assert r["forward_ms_per_step"] > 0 and 0 < r["host_ms_per_step"] <= r["wall_ms_per_step"]
        assert 0 <= r["hidden_ms_per_step"] <= r["forward_ms_per_step"]
