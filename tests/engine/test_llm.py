"""The engine end to end on tiny local models: goldens against transformers, identical tokens under
every scheduling mode (async depth, prefix caching, preemption, n-gram drafts, sim + sanitizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model
from tests.engine.workloads import mixed_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL = {"max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def generate(
    model: Path, tokens: list[list[int]], params: SamplingParams = GREEDY, **kw
) -> list[list[int]]:
    llm = LLM(str(model), **{**SMALL, **kw})
    outs = llm.generate([{"prompt_token_ids": t} for t in tokens], params, use_tqdm=False)
    assert llm.engine.stats().num_hazards == 0
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ours = generate(path, mixed_prompts()[:3])
    for tokens, got in zip(mixed_prompts()[:3], ours, strict=True):
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
SIM = {"device": "sim", "poison": True, "sanitize": True}
# The equivalence matrix of every scheduling mode on cpu and sim: tests/engine/test_matrix.py.


def test_prefix_hits_are_reported_and_change_nothing(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    first = llm.generate([{"prompt_token_ids": mixed_prompts()[0]}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": mixed_prompts()[0]}], GREEDY, use_tqdm=False)[0]
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
    a = generate(gemma3, mixed_prompts(), params, async_scheduling=False)
    b = generate(gemma3, mixed_prompts(), params, async_depth=3, device="sim")
    assert a == b
    c = generate(
        gemma3,
        mixed_prompts(),
        SamplingParams(max_tokens=16, temperature=0.9, seed=8, ignore_eos=True),
    )
    assert c != a


def test_a_nan_logit_under_sampling_finishes_the_request(llama: Path) -> None:
    """Logits holding a NaN (an overflow, a bad weight) have no distribution to draw from: a
    sampled request draws the NaN's token, as a greedy one does, and finishes. The inverse CDF
    alone drew the vocabulary's size, and the next step's embedding lookup failed the op."""
    llm = LLM(str(llama), **SMALL)
    with torch.no_grad():
        llm.engine.model.decoder.lm_head.weight[5] = float("nan")
    vocab = llm.engine.model_config.vocab_size
    for params in (
        SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ):
        out = llm.generate({"prompt_token_ids": [3, 4, 6, 7]}, params, use_tqdm=False)
        got = out[0].outputs[0]
        assert got.finish_reason == "length" and got.token_ids[0] == 5, params
        assert all(0 <= t < vocab for t in got.token_ids), params


def test_logprobs_are_returned(llama: Path) -> None:
    llm = LLM(str(llama), **SMALL)
    out = llm.generate(
        "abc", SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False
    )
    lps = out[0].outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, lp in zip(out[0].outputs[0].token_ids, lps, strict=True):
        assert len(lp.top) == 3 and tok in lp.top and lp.logprob <= 0.0


def test_logprobs_are_those_of_the_model_whatever_the_filters(llama: Path) -> None:
    """vLLM's default logprobs_mode (raw_logprobs): log_softmax of the model's logits, before
    temperature, top-k/top-p/min-p and the min_tokens ban: finite, and equal to transformers'."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager").eval()
    llm = LLM(str(llama), **SMALL)
    prompt = [5, 17, 40, 41, 99, 3]
    filters = [{"top_k": 2}, {"top_p": 0.1}, {"min_p": 0.5}]
    for i, f in enumerate(filters):
        params = SamplingParams(
            max_tokens=6, min_tokens=4, temperature=0.8, seed=i, logprobs=5, **f
        )
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # [outputs, vocab]
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(float(expected[j, tok]), abs=1e-4)
            top = expected[j].topk(5)
            assert list(lp.top) == top.indices.tolist()
            assert list(lp.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        # the filters keep one or two tokens per step: the other candidates are finite too
        assert all(len(lp.top) == 5 for lp in out.logprobs)
        assert all(v > float("-inf") for lp in out.logprobs for v in lp.top.values())


def test_bad_requests_are_refused_and_lose_nothing(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 99999]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(str(gemma3), block_sise=4)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(str(gemma3), logprobs_mode="processed")
    ok = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize("device", ["sim", "cpu"])
@pytest.mark.parametrize(
    ("protect", "kinds"),
    [("none", {"WAR", "WAW"}), ("event", {"WAR", "WAW"}), ("event,settled", {"WAW", "WAR"})],
)
def test_without_the_quarantine_the_sanitizer_catches_reuse(
    protect: str, kinds: set[str], device: str, gemma3: Path
) -> None:
    """Async depth 2, a tight pool, window layers. With neither protection, a window block the
    step in flight still reads is handed to a new owner (H2); with the settled basis alone,
    preemption frees blocks the step in flight still writes (H3, which only the quarantine
    covers). Either way the new owner's allocation-time poison write races with the pending
    forward, and the sanitizer reports it. (`only-quarantine` above shows the quarantine alone
    suffices.)"""
    from kvtier.device import RaceError

    llm = LLM(str(gemma3), **{**SMALL, **SIM, **TIGHT, "protect": protect, "device": device})
    with pytest.raises(RaceError) as info:
        llm.generate([{"prompt_token_ids": t} for t in mixed_prompts()], GREEDY, use_tqdm=False)
    assert {h.kind for h in info.value.hazards} <= kinds
    assert info.value.hazards
