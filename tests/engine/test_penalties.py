"""Penalties, logit bias, bad words and allowed token ids through the engine: greedy outputs equal
a token-by-token reference built from the engine's raw logits (vLLM's semantics applied in the
test), and every scheduling mode (sync, async depth 2 and 3, n-gram drafts, preemption) gives each
request the same tokens, greedy or seeded, with the sanitizer raising and NaN poison."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.prompts import bad_words_token_ids
from kvtier.sampling import DrawParams
from tests.engine.test_matrix import CHECKED, SMALL, TIGHT
from tests.engine.workloads import Watchdog, check_clean, mixed_prompts
from tests.model.test_adjust import reference

COMMON = {"max_tokens": 20, "ignore_eos": True}
GREEDY_ADJUSTED = [
    SamplingParams(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4
    ),
    SamplingParams(temperature=0.0),  # a row nothing adjusts, in the same batches
    # the byte tokenizer: "2}" is [53, 128], which this prompt outputs unadjusted
    SamplingParams(temperature=0.0, bad_words=["2}", "c"]),
    SamplingParams(temperature=0.0, allowed_token_ids=list(range(3, 60)), frequency_penalty=1.5),
    SamplingParams(temperature=0.0, repetition_penalty=0.7, logit_bias={311: -100, 40: 2.5}),
]
SEEDED = [
    SamplingParams(temperature=0.8, seed=7 + i, repetition_penalty=1.2, presence_penalty=1.0)
    for i in range(5)
]
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async2": {"async_depth": 2},
    "async3": {"async_depth": 3},
    "ngram-drafts": {"num_speculative_tokens": 3},
    "async3-drafts": {"async_depth": 3, "num_speculative_tokens": 2},
    "tight-pool-preempts": TIGHT,
}


def with_common(params: SamplingParams) -> SamplingParams:
    fields = {k: v for k, v in vars(params).items() if not k.startswith("_")}
    return SamplingParams(**(fields | COMMON))


def run(llm: LLM, params: list[SamplingParams]) -> list[tuple[int, ...]]:
    """The prompts of `mixed_prompts` as one batch, prompt i with params[i]."""
    engine = llm.engine
    dog = Watchdog(engine, 1000)
    for i, prompt in enumerate(mixed_prompts()):
        engine.add_request(f"r{i}", prompt, with_common(params[i]))
        dog.add(f"r{i}")
    done = dog.drain()
    return [tuple(done[f"r{i}"].token_ids) for i in range(len(params))]


@functools.cache
def alone(
    model: Path, seeded: bool, chunk: int = SMALL["max_num_batched_tokens"]
) -> tuple[tuple[int, ...], ...]:
    """Each prompt alone, synchronously, no cache, its prefill in chunks of at most `chunk`
    tokens. Chunking is a numerics choice, not scheduling: torch's float32 linear of one row sums
    in another order than of 17 rows on some CPUs (the AMD EPYC box: 4e-6 apart), so a prompt
    whose last chunk is one token can move a seeded draw; a mode is compared with a reference
    chunked as it chunks."""
    params = SEEDED if seeded else GREEDY_ADJUSTED
    out = []
    for prompt, p in zip(mixed_prompts(), params, strict=True):
        sized = {**SMALL, "max_num_batched_tokens": chunk}
        llm = LLM(str(model), **sized, async_scheduling=False, enable_prefix_caching=False)
        got = llm.generate({"prompt_token_ids": prompt}, with_common(p), use_tqdm=False)
        out.append(tuple(got[0].outputs[0].token_ids))
    return tuple(out)


def test_greedy_outputs_equal_the_reference_on_the_raw_logits(gemma3: Path) -> None:
    """The reference asks the engine for one token at a time with every raw logit back, applies
    the adjustments to them itself and takes the argmax."""
    llm = LLM(str(gemma3), **SMALL, max_logprobs=400, logprobs_mode="raw_logits")
    vocab = llm.engine.model_config.vocab_size
    tokenizer = llm.engine.tokenizer
    for prompt, p, got in zip(mixed_prompts(), GREEDY_ADJUSTED, alone(gemma3, False), strict=True):
        draw = p.draw_params(bad_words_token_ids(tokenizer, p.bad_words or ()))
        out: list[int] = []
        for _ in range(COMMON["max_tokens"]):
            one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab, ignore_eos=True)
            lps = llm.generate({"prompt_token_ids": prompt + out}, one, use_tqdm=False)
            top = lps[0].outputs[0].logprobs[0].top
            row = torch.full((vocab,), float("-inf"))
            for t, value in top.items():
                row[t] = value
            reference(row, draw, prompt, out, vocab)
            out.append(int(row.argmax()))
        assert tuple(out) == got
    plain = LLM(str(gemma3), **SMALL, async_scheduling=False)
    unadjusted = run(plain, [SamplingParams(temperature=0.0)] * 5)
    assert [a != b for a, b in zip(unadjusted, alone(gemma3, False))] == [
        True,
        False,
        True,
        True,
        True,
    ]


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_every_mode_gives_each_request_its_tokens_alone(
    mode: str, device: str, seeded: bool, gemma3: Path
) -> None:
    config = {**SMALL, **CHECKED, "device": device, **MODES[mode]}
    llm = LLM(str(gemma3), **config)
    params = SEEDED if seeded else GREEDY_ADJUSTED
    assert run(llm, params) == list(alone(gemma3, seeded, config["max_num_batched_tokens"]))
    check_clean(llm)


def test_adjusted_draw_params_reach_the_runner() -> None:
    p = SamplingParams(presence_penalty=0.5, logit_bias={3: 200.0}, allowed_token_ids=[3, 4])
    draw = p.draw_params(((5, 6),))
    assert draw == DrawParams(
        presence_penalty=0.5,
        logit_bias=((3, 200.0),),
        allowed_token_ids=(3, 4),
        bad_words_token_ids=((5, 6),),
    )
