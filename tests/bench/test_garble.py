"""`kvtier bench garble` end to end on a small workload: with no protection the store race corrupts
host copies that later rounds load back (garbled completions, RAW hazards); with all protections,
or the ones covering the store path alone, nothing is garbled and the sanitizer is silent."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli import main


def test_garble_table_shows_each_protection(tmp_path: Path) -> None:
    out = tmp_path / "garble.json"
    rc = main(
        [
            "bench", "garble", "--num-prompts", "24", "--rounds", "2", "--concurrency", "12",
            "--max-tokens", "32", "--dtype", "float32", "--variants", "none,event,settled,all",
            "--out", str(out), "--plot", str(tmp_path / "garble.png"),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["none"]["garbled"] > 0 and rows["none"]["hazard_kinds"]["RAW"] > 0
    for name in ("event", "settled", "all"):
        assert rows[name]["garbled"] == 0 and rows[name]["hazards"] == 0, name
    assert all(r["total"] == 48 and r["host_hit_rate"] > 0 for r in rows.values())
    assert (tmp_path / "garble.png").stat().st_size > 0
