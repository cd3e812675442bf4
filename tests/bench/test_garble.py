"""`kvtier bench garble` end to end on a small workload: with no protection the store race corrupts
host copies that later rounds load back (garbled completions, RAW hazards); with all protections,
or the ones covering the store path alone, nothing is garbled and the sanitizer is silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def _rows(tmp_path: Path, scenario: str, variants: str, rounds: int) -> dict[str, dict]:
    out = tmp_path / f"{scenario}.json"
    rc = main(
        [
            "bench", "garble", "--scenario", scenario, "--num-prompts", "24", "--rounds", str(rounds),
            "--concurrency", "12", "--max-tokens", "48", "--dtype", "float32",
            "--variants", variants, "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    return {r["variant"]: r for r in json.loads(out.read_text())["rows"]}


def test_finish_scenario_needs_the_quarantine(tmp_path: Path) -> None:
    """H3: requests stop at a sentence end found while their next step is in flight; without the
    quarantine (and without the event) a load lands in their blocks under that step."""
    rows = _rows(tmp_path, "finish", "settled,settled+quarantine", rounds=2)  # 2: host hits
    assert rows["settled"]["hazards"] > 0
    assert rows["settled+quarantine"]["hazards"] == 0
    assert rows["settled+quarantine"]["garbled"] == 0


def test_drafts_scenario_needs_the_settled_basis(tmp_path: Path) -> None:
    """H4: with pruning on the optimistic count, rejected drafts make the next step read window
    blocks already handed to another request (poisoned): garbled although the quarantine and the
    event are on; pruning on the settled count (with the quarantine) is clean."""
    rows = _rows(tmp_path, "drafts", "event+quarantine,settled+quarantine", rounds=1)
    assert rows["event+quarantine"]["garbled"] > 0
    assert rows["settled+quarantine"]["garbled"] == 0
    assert rows["settled+quarantine"]["hazards"] == 0


def test_unknown_protection_in_a_variant_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "garble", "--variants", "settled+quarantene", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "'quarantene'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _windowed_hybrid(tmp_path: Path) -> Path:
    from kvtier.model.testing import write_tiny_model

    kinds = ["sliding_attention", "sliding_attention", "full_attention"]
    return write_tiny_model(
        tmp_path / "falcon-h1-windowed", "falcon_h1", num_kv_heads=4, mamba_d_state=4,
        mamba_n_groups=1, layer_types=kinds, sliding_window=16,
    )  # fmt: skip


def test_with_prefix_caching_state_groups_take_part_in_the_draft_hazard(tmp_path: Path) -> None:
    """H4 on a hybrid with a state page per block (`--prefix-caching`): pruning on the optimistic
    count frees state pages a step launched with unverified drafts still touches; the settled
    basis with the quarantine is clean (architecture.md §Garble)."""
    out = tmp_path / "drafts.json"
    rc = main(
        [
            "bench", "garble", "--model", str(_windowed_hybrid(tmp_path)), "--scenario", "drafts",
            "--prefix-caching", "--num-prompts", "16", "--rounds", "1", "--concurrency", "8",
            "--max-tokens", "32", "--block-size", "4", "--dtype", "float32",
            "--variants", "event+quarantine,settled+quarantine", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["event+quarantine"]["state_hazards"] > 0
    assert rows["event+quarantine"]["garbled"] > 0
    assert rows["settled+quarantine"]["hazards"] == rows["settled+quarantine"]["garbled"] == 0


def test_state_groups_take_part_in_the_finish_hazard(tmp_path: Path) -> None:
    """On a hybrid with window, full and state groups (a windowed Falcon-H1 toy): a request
    finishing while its next step is in flight frees its state page; without the quarantine a load
    lands there before the stale step's state write (WAW on a state page, garbled completions).
    The seed's "Mamba layers are not affected" holds for readers only (architecture.md §Garble)."""
    folder = _windowed_hybrid(tmp_path)
    out = tmp_path / "hybrid.json"
    rc = main(
        [
            "bench", "garble", "--model", str(folder), "--scenario", "finish", "--num-prompts",
            "16", "--rounds", "2", "--concurrency", "8", "--max-tokens", "32", "--block-size", "4",
            "--dtype", "float32", "--variants", "settled,settled+quarantine", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["settled"]["state_hazards"] > 0 and rows["settled"]["garbled"] > 0
    assert rows["settled+quarantine"]["hazards"] == rows["settled+quarantine"]["garbled"] == 0


@pytest.mark.parametrize(
    ("scenario", "device", "depth", "offload", "drafts", "expected"),
    [
        ("offload", "sim", 2, True, 0, "scenario offload (sim, async depth 2, host tier)"),
        ("finish", "sim", 3, True, 0, "scenario finish (sim, async depth 3, host tier)"),
        ("drafts", "cpu", 2, False, 4, "scenario drafts (cpu, async depth 2, 4 n-gram drafts)"),
    ],
)
def test_chart_title_names_the_run_it_shows(
    scenario: str, device: str, depth: int, offload: bool, drafts: int, expected: str
) -> None:
    """Every chart once said "sim, async depth 2, offload", whatever the scenario ran."""
    from kvtier.bench.garble import chart_title

    assert chart_title(scenario, device, depth, offload, drafts).endswith(expected)
