"""The host tier in the engine: with a device pool too small to keep the prefixes, later rounds
load them back from host memory — and every completion equals the run without offload, on the sim
device with the sanitizer raising and NaN poison in recycled blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BASE = {
    "max_model_len": 64,
    "block_size": 4,
    "max_num_batched_tokens": 32,
    "device": "sim",
    "sanitize": True,
    "poison": True,
    "check_integrity": True,
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3-offload"), "gemma3", window=8)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 40))] for _ in range(8)]


def rounds(path: Path, **kw: object) -> tuple[list[list[list[int]]], LLM]:
    """Three rounds of the same prompts (later rounds hit whatever cache kept them)."""
    llm = LLM(str(path), **{**BASE, **kw})
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outs = [
        [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        for _ in range(3)
    ]
    return outs, llm


@pytest.fixture(scope="module")
def reference(gemma3: Path) -> list[list[list[int]]]:
    return rounds(gemma3, num_device_blocks=400)[0]


@pytest.mark.parametrize(
    "protect", ["event,settled,quarantine", "event", "settled,quarantine", "event,quarantine"]
)
def test_offload_reloads_evicted_prefixes_with_the_same_tokens(
    gemma3: Path, reference: list[list[list[int]]], protect: str
) -> None:
    outs, llm = rounds(gemma3, num_device_blocks=80, num_host_blocks=400, protect=protect)
    assert outs == reference
    tier = llm.engine.host_tier
    assert tier is not None
    assert tier.metrics.num_loaded_blocks > 0 and tier.metrics.num_stored_blocks > 0
    assert not llm.engine.device.hazards
    llm.engine.check_integrity()


def test_stores_race_the_forward_without_settled_counts_or_the_event(gemma3: Path) -> None:
    """H1: with stores planned from the optimistic count and no compute-done event, a store
    reads a block before the forward that writes it; the sanitizer reports the RAW."""
    from kvtier.device import RaceError

    with pytest.raises(RaceError) as info:
        rounds(gemma3, num_device_blocks=80, num_host_blocks=400, protect="none")
    assert {h.kind for h in info.value.hazards} == {"RAW"}
    assert all(
        h.first.meta.label == "store" or h.second.meta.label == "store" for h in info.value.hazards
    )


def test_failed_loads_roll_back_and_recompute_with_the_same_tokens(
    gemma3: Path, reference: list[list[list[int]]]
) -> None:
    """H7: every other load reports failure; its request rolls back to its last good block and
    recomputes the rest, and no completion changes."""
    llm = LLM(str(gemma3), **{**BASE, "num_device_blocks": 80, "num_host_blocks": 400})
    transfers = llm.engine.runner.transfers
    launch = transfers.launch_loads

    def failing(planned: list, step_seq: int) -> None:  # type: ignore[type-arg]
        transfers.fail_ids.update(t.transfer_id for t in planned if t.is_load and t.transfer_id % 2)
        launch(planned, step_seq)

    transfers.launch_loads = failing  # type: ignore[method-assign]
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outs = [
        [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        for _ in range(3)
    ]
    assert outs == reference
    tier = llm.engine.host_tier
    assert tier is not None and tier.metrics.num_failed_loads > 0
    llm.engine.check_integrity()
