"""Prompt logprobs as vLLM returns them: None for the first prompt token, then the prompt token's
logprob and the top candidates of the model's distribution at every later position, equal to
transformers', the same however the prompt is chunked, and never served from the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, EngineArgs, EngineCore, FinishedRequest, SamplingParams
from tests.engine.workloads import mixed_prompts

SMALL = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32}
SIM = {"device": "sim", "sanitize": True, "poison": True, "check_integrity": True}


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 40))] for _ in range(n)]


def asking(n: int | None = 3, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=n)


def test_requests_asking_for_prompt_logprobs_skip_the_prefix_cache(gemma3: Path) -> None:
    """Every prompt position must be computed (vLLM skips the lookup for them): no device hit,
    and no host-tier load either."""
    llm = LLM(str(gemma3), **{**SMALL, **SIM, "num_device_blocks": 80, "num_host_blocks": 400})
    batch = [{"prompt_token_ids": p} for p in prompts(8)]
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second round hits the device cache or loads from the host
        again = llm.generate(batch, plain, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    m = llm.engine.stats().host_metrics
    assert m is not None and m.num_loaded_blocks > 0
    loaded = m.num_loaded_blocks
    outs = llm.generate(batch, asking(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * len(batch)
    stats = llm.engine.stats()
    assert stats.host_metrics is not None and stats.host_metrics.num_loaded_blocks == loaded
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    assert stats.num_hazards == 0


def reference_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every prompt position [len(prompt), vocab] (row i predicts
    token i + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


def test_prompt_logprobs_are_the_models_as_vllm_shapes_them(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL, **SIM)
    batch = prompts(3)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [asking(3), asking(0), asking(None)],
        use_tqdm=False,
    )
    assert outs[2].prompt_logprobs is None  # not asked
    for prompt, out, k in zip(batch[:2], outs[:2], (3, 0), strict=True):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        expected = reference_logprobs(gemma3, prompt)
        for i in range(1, len(prompt)):
            entry = got[i]
            assert entry is not None
            top = expected[i - 1].topk(k) if k else None
            wanted = {prompt[i]: float(expected[i - 1, prompt[i]])}
            if top is not None:
                wanted |= dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            assert entry.keys() == wanted.keys()  # the prompt token and the top k (may overlap)
            assert next(iter(entry)) == prompt[i]  # the prompt token first, as vLLM
            assert list(entry.values()) == pytest.approx([wanted[t] for t in entry], abs=1e-4)
    assert llm.engine.stats().num_hazards == 0


def test_chunked_prefill_gives_the_same_prompt_logprobs(gemma3: Path) -> None:
    batch = [{"prompt_token_ids": p} for p in prompts(4, seed=1)]
    whole = LLM(str(gemma3), **SMALL, **SIM).generate(batch, asking(), use_tqdm=False)
    chunks = {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 3}
    chunked = LLM(str(gemma3), **{**SMALL, **SIM, **chunks}).generate(
        batch, asking(), use_tqdm=False
    )
    for a, b in zip(whole, chunked, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x is not None and y is not None and x.keys() == y.keys()
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def run_engine(path: Path, **config: object) -> dict[str, FinishedRequest]:
    engine = EngineCore(EngineArgs.from_kwargs(str(path), **{**SMALL, **SIM, **config}))
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # prompts sharing a prefix: in the tight pool below, the one asking (3) is preempted
    for i, prompt in enumerate(mixed_prompts()):
        engine.add_request(f"r{i}", prompt, asking(2, max_tokens=24) if i == 3 else plain)
    done = engine.drain()
    assert engine.stats().num_hazards == 0
    return done


@pytest.mark.parametrize(
    "config",
    [
        {"async_depth": 3, "num_speculative_tokens": 2},
        # preempts the one asking (admitting on first chunks over-admits into this pool)
        {
            "num_device_blocks": 70,
            "max_num_batched_tokens": 16,
            "scheduler_reserve_full_isl": False,
        },
        {"async_scheduling": False, "device": "cpu", "sanitize": False},
    ],
    ids=["async3-drafts", "tight-pool", "cpu-sync"],
)
def test_prompt_logprobs_survive_every_scheduling_mode(gemma3: Path, config: dict) -> None:
    expected = run_engine(gemma3, async_scheduling=False)["r3"]
    states = run_engine(gemma3, **config)
    assert all(states[f"r{i}"].prompt_logprobs is None for i in (0, 1, 2, 4))
    got, want = states["r3"].prompt_logprobs, expected.prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == 37
    assert got[0] is None and all(lp is not None for lp in got[1:])
    for x, y in zip(want[1:], got[1:], strict=True):
        assert x is not None and y is not None and x.top.keys() == y.top.keys()
        assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
        assert list(y.top.values()) == pytest.approx(list(x.top.values()), abs=1e-5)
    assert states["r3"].token_ids == expected.token_ids
    if "num_device_blocks" in config:
        assert states["r3"].num_preemptions > 0
