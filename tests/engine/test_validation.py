"""Hostile request inputs at the engine boundary: each is refused with an error naming the field,
nothing of it is recorded, and the good request batched beside it finishes with its usual tokens.
Before these checks, every case below either killed the engine in its next step or sampled
silently wrong tokens (issue 12, items 1-3, 15, 16)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams
from kvtier.model.testing import write_tiny_model

VOCAB = 320  # the tiny models' vocabulary
ARGS = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32}
PROMPT = [5, 6, 7, 8, 9]
GOOD = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(path: Path, **kw: Any) -> EngineCore:
    return EngineCore(EngineArgs.from_kwargs(str(path), **{**ARGS, **kw}))


@functools.cache
def alone(path: Path, params: SamplingParams = GOOD) -> list[int]:
    """The good request's tokens on a fresh engine, by itself."""
    eng = engine(path)
    eng.add_request("good", PROMPT, params)
    return eng.drain()["good"].token_ids


def assert_idle(eng: EngineCore) -> None:
    """Nothing held or unfinished, no step in flight, every KV block free again."""
    assert not eng.has_unfinished_requests()
    stats = eng.stats()
    assert stats.num_requests == 0 and stats.device.usage == 0.0
    eng.check_integrity()


def refused_beside_good(
    path: Path,
    make_params: Callable[[], SamplingParams],
    tokens: list[Any] = PROMPT,
    good: SamplingParams = GOOD,
    **engine_kw: Any,
) -> Exception | None:
    """Submit the bad request (its params built inside, so a refusal at construction counts),
    then a good one, and run both to the end; return the bad one's refusal (None if accepted).
    Without a refusal the bad request reaches the step, which is where the engine used to die."""
    eng = engine(path, **engine_kw)
    refusal: Exception | None = None
    try:
        eng.add_request("bad", tokens, make_params())
    except (ValueError, TypeError) as exc:
        refusal = exc
    eng.add_request("good", PROMPT, good)
    if refusal is not None:  # the refused request left no trace: only "good" is held
        assert eng.stats().num_requests == 1
    done = eng.drain()
    assert done["good"].token_ids == alone(path, good)
    if refusal is not None:
        assert set(done) == {"good"}
        assert eng.stats().is_idle  # nothing waits, runs or holds a block: no zombie
    assert_idle(eng)
    return refusal


def assert_names(refusal: Exception | None, *words: str) -> None:
    assert refusal is not None, "the bad request was accepted"
    assert isinstance(refusal, (ValueError, TypeError))
    for word in words:
        assert word in str(refusal), f"{word!r} not in {refusal}"


# ---- item 1: stop_token_ids outside the vocabulary -------------------------------------------


@pytest.mark.parametrize("bad", [5000, VOCAB, -5000, 10**30])
def test_stop_token_id_outside_the_vocabulary_is_refused(llama: Path, bad: int) -> None:
    refusal = refused_beside_good(
        llama, lambda: SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[3, bad])
    )
    assert_names(refusal, "stop_token_ids", str(bad))


def test_stop_token_id_past_the_vocabulary_names_the_range(llama: Path) -> None:
    refusal = refused_beside_good(
        llama, lambda: SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5000])
    )
    assert_names(refusal, "stop_token_ids", "5000", f"[0, {VOCAB})")


def test_negative_stop_token_id_no_longer_bans_a_real_token(llama: Path) -> None:
    """`[t - vocab]` used to mask token t (negative indexing) until min_tokens outputs."""
    first = alone(llama)[0]
    refusal = refused_beside_good(
        llama,
        lambda: SamplingParams(
            max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=[first - VOCAB]
        ),
    )
    assert_names(refusal, "stop_token_ids", str(first - VOCAB))


# ---- item 2: integers that reach a tensor ------------------------------------------------------

SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=1, ignore_eos=True)


def test_huge_top_k_batched_with_an_ordinary_one_is_refused(llama: Path) -> None:
    refusal = refused_beside_good(
        llama, lambda: SamplingParams(max_tokens=4, top_k=10**30), good=SAMPLED
    )
    assert_names(refusal, "top_k")


def test_top_k_beyond_the_vocabulary_is_no_filter_beside_an_ordinary_one(llama: Path) -> None:
    big = SamplingParams(max_tokens=6, temperature=0.8, top_k=2**62, seed=3, ignore_eos=True)
    off = SamplingParams(max_tokens=6, temperature=0.8, top_k=0, seed=3, ignore_eos=True)
    eng = engine(llama)
    eng.add_request("big", PROMPT, big)
    eng.add_request("good", PROMPT, SAMPLED)
    done = eng.drain()
    assert done["big"].token_ids == alone(llama, off)
    assert done["good"].token_ids == alone(llama, SAMPLED)


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("seed", lambda: SamplingParams(seed=2**64)),
        ("seed", lambda: SamplingParams(seed=-(2**63) - 1)),
        ("logprobs", lambda: SamplingParams(logprobs=10**30)),
        ("max_tokens", lambda: SamplingParams(max_tokens=10**30)),
        ("min_tokens", lambda: SamplingParams(max_tokens=4, min_tokens=-1)),
        ("top_k", lambda: SamplingParams(top_k=-2)),
    ],
)
def test_integers_out_of_bounds_are_refused(llama: Path, field: str, make: Any) -> None:
    assert_names(refused_beside_good(llama, make, good=SAMPLED), field)


def test_logprobs_above_max_logprobs_are_refused_by_the_engine(llama: Path) -> None:
    refusal = refused_beside_good(llama, lambda: SamplingParams(max_tokens=2, logprobs=21))
    assert_names(refusal, "logprobs", "max_logprobs")
    refusal = refused_beside_good(llama, lambda: SamplingParams(max_tokens=2, prompt_logprobs=21))
    assert_names(refusal, "prompt_logprobs", "max_logprobs")
    eng = engine(llama, max_logprobs=40)
    eng.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0, logprobs=40))
    logprobs = eng.drain()["r"].logprobs
    assert logprobs is not None and all(len(lp.top) == 40 for lp in logprobs)


def test_seeds_across_the_whole_generator_range_sample(llama: Path) -> None:
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=seed)
        assert refused_beside_good(llama, lambda p=params: p) is None


# ---- item 3: wrong types -----------------------------------------------------------------------

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("seed", {"seed": "x"}),
        ("seed", {"seed": 1.5}),
        ("seed", {"seed": True}),
        ("stop", {"stop": [1, 2]}),
        ("stop", {"stop": ""}),
        ("stop", {"stop": ["ok", ""]}),
        ("top_k", {"top_k": 2.5}),
        ("stop_token_ids", {"stop_token_ids": "abc", "min_tokens": 2}),
        ("stop_token_ids", {"stop_token_ids": [2.0], "min_tokens": 2}),
        ("temperature", {"temperature": NAN}),
        ("temperature", {"temperature": INF}),
        ("temperature", {"temperature": -INF}),
        ("temperature", {"temperature": "0.5"}),
        ("top_p", {"top_p": NAN}),
        ("min_p", {"min_p": NAN}),
        ("max_tokens", {"max_tokens": 4.0}),
        ("logprobs", {"logprobs": 1.5}),
        ("ignore_eos", {"ignore_eos": "no"}),
        ("skip_special_tokens", {"skip_special_tokens": None}),
    ],
)
def test_wrong_types_and_non_finite_values_are_refused(
    llama: Path, field: str, kwargs: dict[str, Any]
) -> None:
    refusal = refused_beside_good(llama, lambda: SamplingParams(**{"max_tokens": 4, **kwargs}))
    assert_names(refusal, field)


@pytest.mark.parametrize(
    "tokens", [[5, 5.5, 7], [5, "6"], [5, True], [5, None], [5, [6]], "abc", 7]
)
def test_prompt_token_ids_of_the_wrong_type_are_refused(llama: Path, tokens: Any) -> None:
    refusal = refused_beside_good(llama, lambda: SamplingParams(max_tokens=4), tokens=tokens)
    assert_names(refusal, "prompt_token_ids")


@pytest.mark.parametrize("priority", ["high", 1.5, None, 10**30])
def test_bad_priority_is_refused_and_leaves_no_zombie_id(llama: Path, priority: Any) -> None:
    eng = engine(llama, policy="priority")
    eng.add_request("first", PROMPT, GOOD)
    with pytest.raises((ValueError, TypeError), match="priority"):
        eng.add_request("bad", PROMPT, GOOD, priority)
    eng.add_request("bad", PROMPT, GOOD, 1)  # the id is free: nothing was recorded
    done = eng.drain()
    assert done["bad"].token_ids == done["first"].token_ids == alone(llama)
    assert_idle(eng)


def test_params_of_the_wrong_kind_and_odd_ids_are_refused(llama: Path) -> None:
    eng = engine(llama)
    with pytest.raises(TypeError, match="sampling_params"):
        eng.add_request("r", PROMPT, {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request id"):
        eng.add_request(7, PROMPT, GOOD)  # type: ignore[arg-type]
    assert eng.stats().num_requests == 0 and not eng.has_unfinished_requests()


def test_numpy_integers_are_accepted_as_python_ints(llama: Path) -> None:
    np = pytest.importorskip("numpy")
    params = SamplingParams(
        max_tokens=np.int64(6), temperature=0, ignore_eos=True, seed=np.int32(1)
    )
    assert type(params.max_tokens) is int and type(params.seed) is int
    eng = engine(llama)
    eng.add_request("r", list(np.array(PROMPT)), params)
    done = eng.drain()["r"]
    assert done.token_ids == alone(llama)
    assert all(type(t) is int for t in done.prompt_token_ids + done.token_ids)


def test_lists_are_normalised_to_tuples() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])
    assert params.stop == ("a", "b") and params.stop_token_ids == (3, 4)
    assert SamplingParams(stop="a").stop_strings == ("a",)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)))


# ---- item 15: LLM.generate refuses a batch as a whole ------------------------------------------


@pytest.fixture(scope="module")
def llm(llama: Path) -> LLM:
    return LLM(str(llama), **ARGS)


def assert_llm_clean(llm: LLM) -> None:
    assert_idle(llm.engine)
    out = llm.generate({"prompt_token_ids": PROMPT}, GOOD, use_tqdm=False)
    assert out[0].outputs[0].token_ids == alone(Path(llm.engine.args.model_path))


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [1, 99999]}], "vocabulary"),
        ([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [5, 5.5]}], "prompt_token_ids"),
        ([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [5] * 80}], "max_model_len"),
        ([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": []}], "empty"),
        ([{"prompt_token_ids": PROMPT}, 42], "prompt"),
        ([{"prompt_token_ids": PROMPT}, {"text": "x"}], "prompt"),
        ([{"prompt_token_ids": PROMPT}, "a\ud800"], r"prompts\[1\].*surrogate"),
        ([{"prompt_token_ids": PROMPT}, {"prompt": "\udfff"}], r"prompts\[1\].*surrogate"),
    ],
)
def test_a_refused_prompt_leaves_nothing_of_its_batch(
    llm: LLM, prompts: list[Any], match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, GOOD, use_tqdm=False)
    assert_llm_clean(llm)


def test_refused_sampling_params_leave_nothing_of_the_batch(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": PROMPT}] * 2
    bad = SamplingParams(max_tokens=4, logprobs=30)  # over max_logprobs: only the engine knows
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(prompts, [GOOD, bad], use_tqdm=False)
    assert_llm_clean(llm)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(prompts, [GOOD, {"temperature": 0}], use_tqdm=False)  # type: ignore[list-item]
    assert_llm_clean(llm)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, [GOOD], use_tqdm=False)
    assert_llm_clean(llm)


def test_generate_takes_priorities_and_refuses_bad_ones(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": PROMPT}] * 2
    with pytest.raises(TypeError, match="priority"):
        llm.generate(prompts, GOOD, use_tqdm=False, priority=[0, "high"])
    assert_llm_clean(llm)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts, GOOD, use_tqdm=False, priority=[0])
    assert_llm_clean(llm)
    outs = llm.generate(prompts, GOOD, use_tqdm=False, priority=[1, 0])
    assert [o.outputs[0].token_ids for o in outs] == [alone(llm.engine.args.model_path)] * 2


# ---- item 16: engine arguments the model cannot honour -----------------------------------------


def test_max_model_len_beyond_the_models_positions_is_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len.*max_position_embeddings=1024"):
        engine(llama, max_model_len=1025)
    assert engine(llama, max_model_len=1024).plan.max_model_len == 1024


def test_drafts_beyond_max_model_len_are_refused(llama: Path) -> None:
    """They sized a [max_num_seqs, 1 + k] buffer: 10**9 tried to allocate 2 TB at startup."""
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine(llama, num_speculative_tokens=10**9)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine(llama, num_speculative_tokens=64)  # max_model_len 64: no request has room
    assert engine(llama, num_speculative_tokens=63).args.num_speculative_tokens == 63


def test_host_tier_without_prefix_caching_is_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        engine(llama, num_host_blocks=64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        engine(llama, kv_offloading_size=0.01, enable_prefix_caching=False)


def test_max_logprobs_flag_reaches_the_engine_args() -> None:
    import argparse

    from kvtier.engine.cli import add_engine_arguments, engine_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args(parser.parse_args(["--max-logprobs", "5"])).max_logprobs == 5
    assert engine_args(parser.parse_args([])).max_logprobs == 20


def test_model_may_be_a_path(llama: Path) -> None:
    assert EngineArgs.from_kwargs(llama).model == str(llama)  # type: ignore[arg-type]
