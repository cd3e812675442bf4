"""`kvtier bench preempt` at toy size (issue 12 item 17): on a full-attention model and a tight
device pool, async depth 2 and 3 preempt about as often as depth 1 (before: 28 and 26 against 12,
the quarantine's cascade), and every output equals its prompt run alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import main, preempt
from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.model.testing import write_tiny_model

TOY = [
    "--num-requests", "12", "--min-prompt", "12", "--max-prompt", "20", "--max-tokens", "24",
    "--block-size", "4", "--num-device-blocks", "30", "--max-num-batched-tokens", "64",
]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama-preempt"), "llama")


def alone(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt run by itself (one after the other; sync, no prefix caching)."""
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path), async_scheduling=False, enable_prefix_caching=False, block_size=4
        )
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        out.append(engine.drain()[f"r{i}"].token_ids)
    return out


def test_depth_2_and_3_preempt_within_1_2x_of_sync_with_the_same_tokens(llama: Path) -> None:
    parser = argparse.ArgumentParser()
    preempt.add_arguments(parser)
    args = parser.parse_args(["--model", str(llama), *TOY])
    prompts = preempt.workload(args, 300)
    expected = alone(llama, prompts, args.max_tokens)
    sync = preempt.run_one(args, prompts, 1, True, args.num_device_blocks)
    assert sync["num_preemptions"] > 0, "the pool should force preemptions"
    assert sync["tokens"] == expected and sync["idle_after"]
    for depth in (2, 3):
        r = preempt.run_one(args, prompts, depth, True, args.num_device_blocks)
        assert r["num_preemptions"] <= 1.2 * sync["num_preemptions"], (depth, r, sync)
        assert r["tokens"] == expected and r["idle_after"]


def test_bench_preempt_prints_and_saves_every_configuration(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "preempt.json"
    rc = main(preempt, ["--model", str(llama), *TOY, "--depths", "1", "2", "--out", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    assert saved["same_tokens"] is True
    rows = [(r["async_depth"], r["quarantine"]) for r in saved["results"]]
    assert rows == [(1, True), (2, True), (1, False), (2, False)]
    assert all(r["idle_after"] and r["ratio_to_depth_1"] is not None for r in saved["results"])
