"""The engine end to end on tiny local models: goldens against transformers, identical tokens under
every scheduling mode (async depth, prefix caching, preemption, n-gram drafts, sim + sanitizer)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL = {"max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", window=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def prompts() -> list[list[int]]:
    shared = [(7 * i) % 300 + 3 for i in range(20)]
    return [
        [*shared, 11, 12, 13],
        [*shared, 21, 22],
        list(range(40, 45)),
        [(5 * i) % 251 + 3 for i in range(37)],
        [*shared[:9], 5, 5, 5, 5, 5, 5, 5, 5],  # repetitive: n-gram drafts get accepted
    ]


def generate(
    model: Path, tokens: list[list[int]], params: SamplingParams = GREEDY, **kw
) -> list[list[int]]:
    llm = LLM(str(model), **{**SMALL, **kw})
    outs = llm.generate([{"prompt_token_ids": t} for t in tokens], params, use_tqdm=False)
    assert all(not h for h in llm.engine.device.hazards)
    llm.engine.kv.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def reference(model: Path) -> list[list[int]]:
    """Each prompt alone, synchronous, no prefix caching, CPU."""
    return [
        generate(model, [t], async_scheduling=False, enable_prefix_caching=False)[0]
        for t in prompts()
    ]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ours = generate(path, prompts()[:3])
    for tokens, got in zip(prompts()[:3], ours, strict=True):
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([tokens]), max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert got == ids[0, len(tokens) :].tolist()


# Admitting on the first chunk alone (not the whole prompt) over-admits into this pool: preemptions
TIGHT = {
    "num_device_blocks": 70,
    "max_model_len": 64,
    "max_num_batched_tokens": 16,
    "scheduler_reserve_full_isl": False,
}
# Every configuration runs on the sim device with the race sanitizer on (raising at the first
# hazard) and NaN poison for recycled blocks, except the plain CPU backend rows.
CONFIGS = {
    "cpu-sync": {"device": "cpu", "async_scheduling": False},
    "cpu-async2": {"device": "cpu", "async_depth": 2},
    "sync": {"async_scheduling": False},
    "async2": {"async_depth": 2},
    "async3": {"async_depth": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "tight-pool-preempts": TIGHT,
    "tight-pool-preempts-sync": {**TIGHT, "async_scheduling": False},
    "only-quarantine": {**TIGHT, "protect": "event,quarantine"},
    "ngram-drafts": {"num_speculative_tokens": 3},
    "ngram-drafts-sync": {"num_speculative_tokens": 2, "async_scheduling": False},
    "async3-drafts": {"async_depth": 3, "num_speculative_tokens": 2},
    "chunked-prefill": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
}
SIM = {"device": "sim", "poison": True, "sanitize": True}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_tokens_equal_each_prompt_alone(name: str, gemma3: Path) -> None:
    llm = LLM(str(gemma3), **{**SMALL, **SIM, **CONFIGS[name]})
    outs = llm.generate([{"prompt_token_ids": t} for t in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(gemma3)
    assert not llm.engine.device.hazards
    llm.engine.kv.check_integrity()
    if name.startswith("tight-pool"):
        assert llm.engine.scheduler.num_preemptions > 0
    if "drafts" in name:
        assert llm.engine.runner.num_accepted_tokens > 0


def test_prefix_hits_are_reported_and_change_nothing(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    first = llm.generate([{"prompt_token_ids": prompts()[0]}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompts()[0]}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 20  # 23 prompt tokens: 5 full blocks of 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_stop_strings_min_tokens_and_finish_reasons(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    base = llm.generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop = base.text[5:8]
    cut = llm.generate(
        "hello world", SamplingParams(max_tokens=24, temperature=0, stop=stop), use_tqdm=False
    )
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    eos = llm.engine.eos_token_id
    params = SamplingParams(
        max_tokens=10, min_tokens=10, temperature=1.0, seed=3, stop_token_ids=[base.token_ids[0]]
    )
    forced = llm.generate("hello world", params, use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) == 10 and eos not in forced.token_ids
    assert base.token_ids[0] not in forced.token_ids[:10]


def test_seeded_sampling_is_reproducible_across_modes(gemma3: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    a = generate(gemma3, prompts(), params, async_scheduling=False)
    b = generate(gemma3, prompts(), params, async_depth=3, device="sim")
    assert a == b
    c = generate(
        gemma3, prompts(), SamplingParams(max_tokens=16, temperature=0.9, seed=8, ignore_eos=True)
    )
    assert c != a


def test_logprobs_are_returned(llama: Path) -> None:
    llm = LLM(str(llama), **SMALL)
    out = llm.generate(
        "abc", SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False
    )
    lps = out[0].outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, lp in zip(out[0].outputs[0].token_ids, lps, strict=True):
        assert len(lp.top) == 3 and tok in lp.top and lp.logprob <= 0.0


def test_bad_requests_are_refused_and_lose_nothing(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 99999]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(str(gemma3), block_sise=4)
    ok = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize(
    ("protect", "kinds"),
    [("none", {"WAR", "WAW"}), ("event", {"WAR", "WAW"}), ("event,settled", {"WAW", "WAR"})],
)
def test_without_the_quarantine_the_sanitizer_catches_reuse(
    protect: str, kinds: set[str], gemma3: Path
) -> None:
    """Async depth 2, a tight pool, window layers. With neither protection, a window block the
    step in flight still reads is handed to a new owner (H2); with the settled basis alone,
    preemption frees blocks the step in flight still writes (H3, which only the quarantine
    covers). Either way the new owner's allocation-time poison write races with the pending
    forward, and the sanitizer reports it. (`only-quarantine` above shows the quarantine alone
    suffices.)"""
    from kvtier.device import RaceError

    llm = LLM(str(gemma3), **{**SMALL, **SIM, **TIGHT, "protect": protect})
    with pytest.raises(RaceError) as info:
        llm.generate([{"prompt_token_ids": t} for t in prompts()], GREEDY, use_tqdm=False)
    assert {h.kind for h in info.value.hazards} <= kinds
    assert info.value.hazards
