"""Prompt logprobs as vLLM returns them: None for the first prompt token, then the prompt token's
logprob and the top candidates of the model's distribution at every later position, equal to
transformers', the same however the prompt is chunked, and never served from the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model

SMALL = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32}
SIM = {"device": "sim", "sanitize": True, "poison": True, "check_integrity": True}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3-plp"), "gemma3", window=8)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 40))] for _ in range(n)]


def asking(n: int | None = 3) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=n)


def test_requests_asking_for_prompt_logprobs_skip_the_prefix_cache(gemma3: Path) -> None:
    """Every prompt position must be computed (vLLM skips the lookup for them): no device hit,
    and no host-tier load either."""
    llm = LLM(str(gemma3), **SMALL, **SIM, num_device_blocks=80, num_host_blocks=400)
    batch = [{"prompt_token_ids": p} for p in prompts(8)]
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second round hits the device cache or loads from the host
        again = llm.generate(batch, plain, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    tier = llm.engine.host_tier
    assert tier is not None and tier.metrics.num_loaded_blocks > 0
    loaded = tier.metrics.num_loaded_blocks
    outs = llm.generate(batch, asking(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * len(batch)
    assert tier.metrics.num_loaded_blocks == loaded
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    assert not llm.engine.device.hazards
