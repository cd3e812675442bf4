"""The dated results the docs cite are records in the repository: each `results/NAME_DATE….ext`
named in the README or docs/ exists and is not ignored by git (so a clean checkout has it). An
undated `results/…` path in a command is that benchmark's scratch output and is not checked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATED = re.compile(r"results/[\w.-]*?_\d{4}-\d{2}-\d{2}[a-z]?\.(?:json|png|txt)")


def cited() -> dict[str, str]:
    """Each dated result path cited by the README or a doc → the first file citing it."""
    found: dict[str, str] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in DATED.findall(doc.read_text(encoding="utf-8")):
            found.setdefault(path, str(doc.relative_to(ROOT)))
    return found


def test_the_pattern_takes_dated_names_and_leaves_scratch() -> None:
    text = "see results/bench_router_2026-12-06b.json, results/x_2026-01-02.png; results/bench.png"
    assert DATED.findall(text) == [
        "results/bench_router_2026-12-06b.json",
        "results/x_2026-01-02.png",
    ]


def test_every_cited_dated_result_is_a_committed_record() -> None:
    paths = cited()
    assert paths, "the docs cite no dated result: the pattern no longer matches their names"
    missing = [f"{p} (cited in {doc})" for p, doc in paths.items() if not (ROOT / p).is_file()]
    assert not missing, f"cited results missing from the repository: {missing}"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: whether git ignores them cannot be asked")
    ignored = subprocess.run(
        ["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    assert not ignored, f"cited results that git ignores (never committed): {ignored}"
