"""The one-call decoder layers (model/fused_layer.py) through the engine: bfloat16 on the `cpu`
backend with the race sanitizer raising and NaN poison in recycled blocks, under async depth 3
with n-gram drafts (short multi-token queries) and under preemption in a tight pool — the same
tokens with the one-call layers as without them, and they do serve the decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.model import native
from kvtier.model.fused_layer import FusedLayers
from kvtier.model.testing import write_tiny_model
from tests.engine.workloads import check_clean, mixed_prompts, rounds
from tests.model.paged import record_fused_runs

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.tile_linear, reason="no tile linear here"
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 64, "dtype": "bfloat16"}
CHECKED = {"sanitize": True, "poison": True, "check_integrity": True, "device": "cpu"}
MODES = {
    "async3-drafts": {"async_depth": 3, "num_speculative_tokens": 2},
    "tight-pool-preempts": {
        "num_device_blocks": 70,
        "max_num_batched_tokens": 16,
        "scheduler_reserve_full_isl": False,
    },
}


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, window=8)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_same_tokens_with_and_without_the_one_call_layers(
    mode: str, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = record_fused_runs(monkeypatch)
    llm = LLM(str(model), **{**BASE, **CHECKED, **MODES[mode]})
    fused = rounds(llm, mixed_prompts(), GREEDY, 2)
    check_clean(llm)
    assert sum(served) > len(served) // 2, "the decode steps ran the one-call layers"
    monkeypatch.setattr(FusedLayers, "run", lambda *args, **kwargs: None)
    llm = LLM(str(model), **{**BASE, **CHECKED, **MODES[mode]})
    assert rounds(llm, mixed_prompts(), GREEDY, 2) == fused
    check_clean(llm)
