"""`kvtier bench throughput` end to end at toy size: every prompt gets its tokens, the JSON
carries the cold and warm passes, and the prompts are the seeded random ids bench compare uses."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench.throughput import random_prompts
from kvtier.cli import main


def test_throughput_counts_every_output_token(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(
        [
            "bench", "throughput", "--models", "default", "--dtypes", "float32",
            "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
            "--no-transformers", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    [row] = json.loads(out.read_text())["rows"]
    for run in ("cold", "warm"):
        assert row["kvtier"][run]["output_tokens"] == 4 * 8
        assert row["kvtier"][run]["output_tokens_per_s"] > 0


def test_random_prompts_are_seeded_and_skip_special_ids() -> None:
    a = random_prompts(1, 3, 5, 10)
    assert a == random_prompts(1, 3, 5, 10) and a != random_prompts(2, 3, 5, 10)
    assert [len(p) for p in a] == [5, 5, 5]
    assert all(3 <= t < 10 for p in a for t in p)
