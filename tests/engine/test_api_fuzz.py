"""Property-based fuzz of the Python API: arbitrary keyword combinations for `SamplingParams` and
`EngineArgs`, and `LLM.generate` batches mixing good and bad prompts, params and priorities.

Every call either succeeds or raises TypeError / ValueError naming one of the fields it was given;
afterwards the engine holds no request, every KV block is free, and a normal request returns the
same tokens as on a fresh engine. The engine is read through `EngineCore.stats()` and
`EngineCore.check_integrity()`."""

from __future__ import annotations

import functools
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvtier.config import CacheConfig, SchedulerConfig, StructuredOutputsConfig
from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams
from kvtier.model.testing import write_tiny_model
from kvtier.sampling import StructuredOutputsParams

VOCAB = 320  # the tiny models' vocabulary
MAX_LEN = 48
ARGS = {"max_model_len": MAX_LEN, "block_size": 4, "max_num_batched_tokens": 32}
NORMAL_PROMPT = [5, 6, 7, 8, 9]
NORMAL = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Tests that run the engine take a share of the profile's examples (ci 200: 80 and 40; soak 5000:
# 2000 and 1000).
SCALE = settings.default.max_examples / 200

# ---- hostile values ------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, -2, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1.5, -0.0, 1e-320, 1e308]),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.lists(st.integers(-5, VOCAB + 5), max_size=3),
    st.lists(st.text(max_size=3), max_size=3),
    st.lists(st.lists(st.integers(0, 9), max_size=2), max_size=2),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)

PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([1.0, 0.9, 0.1]),
    "top_k": st.sampled_from([0, -1, 1, 5, VOCAB, 2**40]),
    "min_p": st.sampled_from([0.0, 0.1, 1.0]),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1))),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 25)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 25)),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "presence_penalty": st.sampled_from([0.0, -2.0, 0.5, 2.0]),
    "frequency_penalty": st.sampled_from([0.0, -1.0, 1.5]),
    "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3]),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3)
    ),
    "allowed_token_ids": st.one_of(
        st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)
    ),
    "bad_words": st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "structured_outputs": st.one_of(
        st.none(),
        st.sampled_from(
            [
                StructuredOutputsParams(choice=["yes", "no"]),
                StructuredOutputsParams(regex="[a-c]{1,3}"),
                StructuredOutputsParams(json_object=True),
                StructuredOutputsParams(
                    json={"type": "object", "properties": {"a": {"type": "integer"}}}
                ),
            ]
        ),
    ),
}
SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]
assert sorted(PLAUSIBLE) == sorted(SAMPLING_FIELDS)


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`good` about four times in five (a plain one_of would flatten `bad`'s many branches)."""
    return st.integers(0, 4).flatmap(lambda i: bad if i == 0 else good)


def kwargs_of(
    plausible: dict[str, st.SearchStrategy[Any]], hostile: st.SearchStrategy[Any] | None = HOSTILE
) -> st.SearchStrategy[dict[str, Any]]:
    """A few of the fields, each mostly plausible, sometimes `hostile` (None: never)."""

    def values(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
        if hostile is None:
            return st.fixed_dictionaries({n: plausible[n] for n in names})
        return st.fixed_dictionaries({n: mostly(plausible[n], hostile) for n in names})

    return st.lists(st.sampled_from(sorted(plausible)), unique=True, max_size=5).flatmap(values)


def assert_names_a_field(exc: BaseException, names: list[str]) -> None:
    assert isinstance(exc, (TypeError, ValueError)), f"{type(exc).__name__}: {exc}"
    event(f"refused ({type(exc).__name__})")
    text = str(exc)
    flags = ["--" + n.replace("_", "-") for n in names]
    assert any(n in text for n in [*names, *flags]), f"{text!r} names none of {names}"


def is_finite(x: float) -> bool:
    return type(x) is float and math.isfinite(x)


# ---- SamplingParams alone --------------------------------------------------------------------------


@given(kwargs=kwargs_of(PLAUSIBLE))
def test_sampling_params_accept_or_name_the_field(kwargs: dict[str, Any]) -> None:
    try:
        p = SamplingParams(**kwargs)
    except Exception as exc:
        assert_names_a_field(exc, list(kwargs))
        return
    event("accepted")
    for name in ("max_tokens", "min_tokens", "top_k"):
        assert type(getattr(p, name)) is int
    assert p.seed is None or type(p.seed) is int
    assert p.logprobs is None or type(p.logprobs) is int
    assert p.prompt_logprobs is None or type(p.prompt_logprobs) is int
    assert all(is_finite(getattr(p, n)) for n in ("temperature", "top_p", "min_p"))
    assert p.stop is None or isinstance(p.stop, (str, tuple))
    assert all(isinstance(s, str) and s for s in p.stop_strings)
    assert p.stop_token_ids is None or all(type(t) is int for t in p.stop_token_ids)
    hash(p)  # frozen and made of tuples: usable as a key


# ---- LLM.generate with mixed batches -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(llama: Path) -> LLM:
    return LLM(str(llama), **ARGS)


@functools.cache
def reference(path: Path) -> list[int]:
    fresh = LLM(str(path), **ARGS)
    return (
        fresh.generate({"prompt_token_ids": NORMAL_PROMPT}, NORMAL, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def assert_usable_and_clean(llm: LLM, path: Path) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert stats.num_requests == 0, f"{stats.num_requests} stale requests"
    assert not engine.has_unfinished_requests()
    assert stats.device.usage == 0.0
    engine.check_integrity()
    out = llm.generate({"prompt_token_ids": NORMAL_PROMPT}, NORMAL, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference(path)
    assert engine.stats().num_requests == 0


GOOD_TOKENS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12)
BAD_TOKENS = st.one_of(
    st.lists(st.one_of(st.integers(3, VOCAB - 1), HOSTILE), min_size=1, max_size=6),
    st.lists(st.integers(3, VOCAB - 1), min_size=MAX_LEN, max_size=MAX_LEN + 4),  # too long
    st.just([]),
    HOSTILE,
)
PROMPTS = mostly(
    st.one_of(GOOD_TOKENS.map(lambda t: {"prompt_token_ids": t}), st.text(max_size=12)),
    st.one_of(
        BAD_TOKENS.map(lambda t: {"prompt_token_ids": t}),
        st.fixed_dictionaries({"prompt": HOSTILE}),
        st.fixed_dictionaries({"prompt": st.sampled_from(["\ud800", "a\udfffb"])}),
        st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates: not encodable text
        st.fixed_dictionaries({"prompt_token_ids": GOOD_TOKENS, "prompt": HOSTILE}),
        HOSTILE,
    ),
)
GENERATE_NAMES = ["prompts", "prompt", "prompt_token_ids", "sampling_params", "priority"]


def params_or_junk(kwargs: dict[str, Any]) -> Any:
    """SamplingParams from `kwargs` when they are valid, else the dict itself (which generate
    must refuse as sampling_params)."""
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError):
        return kwargs


PARAMS = kwargs_of(PLAUSIBLE).map(params_or_junk)
VALID_PARAMS = (
    kwargs_of(PLAUSIBLE, None).map(params_or_junk).filter(lambda p: isinstance(p, SamplingParams))
)
GOOD_PROMPTS = st.one_of(GOOD_TOKENS.map(lambda t: {"prompt_token_ids": t}), st.text(max_size=12))


def batch_of(n: int) -> st.SearchStrategy[tuple[list[Any], Any, Any]]:
    """Half the time every part valid (the engine runs it), else each part mostly valid."""
    valid = st.tuples(
        st.lists(GOOD_PROMPTS, min_size=n, max_size=n),
        st.one_of(VALID_PARAMS, st.lists(VALID_PARAMS, min_size=n, max_size=n)),
        st.one_of(st.none(), st.lists(st.integers(-3, 3), min_size=n, max_size=n)),
    )
    mixed = st.tuples(
        st.lists(PROMPTS, min_size=n, max_size=n),
        mostly(
            st.one_of(PARAMS, st.lists(PARAMS, min_size=n, max_size=n)),
            st.one_of(st.lists(PARAMS, max_size=5), HOSTILE),
        ),
        mostly(st.one_of(st.none(), st.lists(st.integers(-3, 3), min_size=n, max_size=n)), HOSTILE),
    )
    return st.one_of(valid, mixed)


BATCHES = st.integers(1, 4).flatmap(batch_of)


@settings(max_examples=int(80 * SCALE))
@given(batch=BATCHES)
def test_generate_refuses_a_batch_whole_or_runs_it(
    llm: LLM, llama: Path, batch: tuple[list[Any], Any, Any]
) -> None:
    prompts, params, priority = batch
    try:
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    except Exception as exc:
        assert_names_a_field(exc, [*GENERATE_NAMES, *SAMPLING_FIELDS])
    else:
        event(f"ran a batch of {len(prompts)}")
        assert len(outs) == len(prompts)
        for out in outs:
            (completion,) = out.outputs
            assert completion.finish_reason in ("stop", "length")
            assert all(type(t) is int and 0 <= t < VOCAB for t in completion.token_ids)
    assert_usable_and_clean(llm, llama)


# ---- EngineArgs ------------------------------------------------------------------------------------

ENGINE_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "dtype": st.sampled_from(["auto", "float32"]),
    "quantization": st.sampled_from([None, "int8", "w8a8", "compressed-tensors"]),  # last: refused
    "enable_kv_cache_events": st.booleans(),
    "device": st.sampled_from(["cpu", "sim"]),
    "seed": st.integers(0, 2**32),
    "num_speculative_tokens": st.integers(0, 3),
    "protect": st.sampled_from(["event,settled,quarantine", "event,quarantine", "quarantine"]),
    "sanitize": st.sampled_from([None, "collect"]),
    "poison": st.booleans(),
    "check_integrity": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "long_prefill_token_threshold": st.integers(0, 8),
    "max_logprobs": st.integers(0, 30),
    "logprobs_mode": st.sampled_from(["raw_logprobs", "processed_logprobs", "raw_logits"]),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "num_device_blocks": st.integers(24, 200),
    "kv_cache_dtype": st.sampled_from([None, "float32", "fp8", "fp8_e5m2", "int8"]),  # int8: no
    "enable_prefix_caching": st.booleans(),
    "prefix_caching_hash_algo": st.sampled_from(["sha256"]),
    "num_host_blocks": st.one_of(st.none(), st.integers(2, 64)),
    "kv_offload_store_mode": st.sampled_from(["eager", "lazy"]),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(8, 64),
    "max_model_len": st.integers(16, 1024),
    "async_scheduling": st.booleans(),
    "async_depth": st.integers(1, 3),
    "kv_cache_memory_bytes": st.one_of(st.none(), st.integers(1 << 16, 1 << 22)),
    "kv_offloading_size": st.one_of(st.none(), st.sampled_from([0.0005, 0.002])),  # GiB
    "torch_threads": st.one_of(st.none(), st.just(1)),  # more would slow the suite down
    "admission": st.sampled_from(["shared", "per-request", "optimistic"]),
    "scheduler_reserve_full_isl": st.booleans(),
    # the tiers below the host hold folders and servers: test_tier_engine.py covers them
    "kv_disk_path": st.none(),
    "kv_disk_size": st.none(),
    "kv_remote_url": st.none(),
    "kv_remote_ttl_s": st.one_of(st.none(), st.just(30.0)),  # without a remote url: refused
    "kv_tier_timeout_s": st.sampled_from([0.05, 0.5]),
    "structured_outputs_max_spec_bytes": st.sampled_from([16, 64 << 10]),
    "structured_outputs_compile_timeout_s": st.sampled_from([0.5, 10.0]),
    "structured_outputs_cache_size": st.integers(1, 8),
    "block_sise": HOSTILE,  # not an engine argument
}
ENGINE_FIELDS = (
    {f.name for f in fields(EngineArgs)} - {"model", "cache", "scheduler", "structured_outputs"}
    | {f.name for f in fields(CacheConfig)}
    | {f.name for f in fields(SchedulerConfig)}
    | {f.name for f in fields(StructuredOutputsConfig)}
    | {"block_sise"}
)
assert sorted(ENGINE_PLAUSIBLE) == sorted(ENGINE_FIELDS)


def engine_kwargs(hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def values(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries({n: mostly(ENGINE_PLAUSIBLE[n], hostile) for n in names})

    return st.lists(st.sampled_from(sorted(ENGINE_PLAUSIBLE)), unique=True, max_size=6).flatmap(
        values
    )


@given(kwargs=engine_kwargs(HOSTILE))
def test_engine_args_accept_or_name_the_field(kwargs: dict[str, Any]) -> None:
    try:
        EngineArgs.from_kwargs(None, **kwargs)
    except Exception as exc:
        assert_names_a_field(exc, list(kwargs))
    else:
        event("accepted")


# Values that are wrong by type or sign only: a valid but huge size (10**9 blocks) would really be
# allocated, which the test above covers without building an engine.
TYPE_HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, math.nan, math.inf, 2.5, "4", "", [1], ()]),
)


@settings(max_examples=int(40 * SCALE))
@given(kwargs=engine_kwargs(TYPE_HOSTILE))
def test_engine_builds_and_answers_or_names_the_field(llama: Path, kwargs: dict[str, Any]) -> None:
    kwargs = {"num_device_blocks": 64, "max_model_len": 64, **kwargs}
    try:
        engine = EngineCore(EngineArgs.from_kwargs(str(llama), **kwargs))
    except Exception as exc:
        assert_names_a_field(exc, list(kwargs))
        return
    try:
        engine.add_request("r", NORMAL_PROMPT, NORMAL)
    except Exception as exc:  # a pool or length too small for the request
        assert_names_a_field(exc, ["max_model_len", "max_tokens", "KV blocks"])
        return
    done = engine.drain()
    event("built and answered")
    assert done["r"].token_ids == reference(llama)
    stats = engine.stats()
    assert stats.device.usage == 0.0 or stats.host is not None
    engine.check_integrity()
