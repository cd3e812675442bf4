"""`kvtier bench sampler` at toy size: every cell timed on both paths, from real calls of the
sampler (native kernels and torch's ops), with the settings it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import main, sampler
from kvtier.model import native


def test_sampler_bench_times_every_setting_on_both_paths(tmp_path: Path) -> None:
    if native.kernels() is None:
        pytest.skip("the native kernels are not built here")
    out = tmp_path / "s.json"
    argv = ["--rows", "1", "3", "--vocab", "64", "--rounds", "1", "--out", str(out)]
    assert main(sampler, argv) == 0
    saved = json.loads(out.read_text())
    cells = {(r["setting"], r["rows"]) for r in saved["rows"]}
    assert cells == {(s, n) for s in sampler.SETTINGS for n in (1, 3)}
    for r in saved["rows"]:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0 and r["vocab"] == 64
    assert saved["config"]["settings"]["top_p"] == {"temperature": 0.7, "top_p": 0.9}
    assert native.draw(torch.zeros(2, 8), torch.ones(2)) is not None  # the kernels are back
