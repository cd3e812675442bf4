"""`kvtier bench grammar` end to end at toy size: both modes decode every token asked for (the
schema cannot end sooner), so their tok/s ratio is the grammar's cost per token."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli import main


def test_grammar_bench_decodes_every_token_in_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    rc = main(
        [
            "bench", "grammar", "--models", "default", "--depths", "2", "--concurrency", "3",
            "--input-len", "8", "--output-len", "6", "--rounds", "1", "--torch-threads", "1",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["async_depth"] for r in rows] == [2]
    for row in rows:
        for mode in ("free", "json_schema"):
            run = row["rounds"][0][mode]
            assert run["output_tokens"] == 3 * 6 and run["finish_reasons"] == ["length"]
        low, high = row["json_over_free_quartiles"]
        assert low == high == row["json_over_free"]  # one round: its ratio


def test_quartiles_bracket_the_median() -> None:
    from kvtier.bench.grammar import quartiles

    assert quartiles([0.9]) == [0.9, 0.9]
    assert quartiles([0.8, 0.9, 1.0, 1.1, 1.2]) == [0.9, 1.1]
