"""`python -m benchmarks.weight_quality` at toy size: every int8 format compared with bfloat16 over
the same teacher-forced tokens, and free greedy runs compared token by token."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import main, weight_quality


def test_weight_quality_compares_every_format_with_bfloat16(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    argv = ["--num-prompts", "2", "--max-tokens", "4", "--out", str(out)]
    assert main(weight_quality, argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == list(weight_quality.FORMATS[1:])
    for r in rows:
        assert r["continuations"] == 2 and 0 <= r["mean_common_prefix"] <= 4
        assert 0.0 <= r["top1_agreement"] <= 1.0 and r["mean_kl"] >= 0.0
        assert r["positions"] > 2 * 4  # the prompts' positions and the continuations'
