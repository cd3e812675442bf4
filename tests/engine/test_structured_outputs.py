"""Structured outputs in the engine: every output of a grammar request is valid — JSON that
validates against its schema (the `jsonschema` library), a choice, a regex match — at every
async depth, with n-gram drafts, under preemption in a tight pool and with the host tier, on the
sim device with the race sanitizer raising, NaN poison and the pool integrity checked after
every step; on a tiny random model and on the embedded one. A grammar request's tokens in every
mode equal its tokens alone, synchronously, without a cache: the matcher follows exactly the
tokens the request settles (architecture.md §Grammar)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvtier.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine import workloads
from tests.engine.workloads import check_clean, check_mode_effects, mixed_prompts, rounds

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "ok"],
            },
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["user", "note"],
    },
    "array-bounds": {
        "type": "object",
        "properties": {
            "xs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["xs"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    "anyof": {
        "type": "object",
        "properties": {
            "v": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 50},
                    {"type": "string", "pattern": "^[a-c]{1,3}$"},
                    {"type": "null"},
                ]
            }
        },
        "required": ["v"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "ranges": {
        "type": "object",
        "properties": {
            "t": {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": 0.25},
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
        },
        "required": ["t", "n"],
    },
}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-f]{2,4}-[0-9]{1,3}"
MAX_TOKENS = 80  # every schema above ends well before (multipleOf bounds the fraction digits)
SMALL = {"max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 64}
CHECKED = {"device": "sim", "sanitize": True, "poison": True, "check_integrity": True}
TIGHT = {"num_device_blocks": 84, "max_num_batched_tokens": 16, "scheduler_reserve_full_isl": False}
HOST = {"num_device_blocks": 120, "num_host_blocks": 600, "max_num_batched_tokens": 16}
MODES: dict[str, dict[str, Any]] = {
    "depth1": {"async_scheduling": False},
    "depth2": {"async_depth": 2},
    "depth3": {"async_depth": 3},
    "ngram-drafts": {"num_speculative_tokens": 3},
    "ngram-drafts-sync": {"num_speculative_tokens": 2, "async_scheduling": False},
    "depth3-drafts": {"async_depth": 3, "num_speculative_tokens": 2},
    "tight-pool-preempts": TIGHT,
    "tight-pool-preempts-drafts": {**TIGHT, "num_speculative_tokens": 2},
    "host-tier": HOST,
    "host-depth3-drafts": {**HOST, "async_depth": 3, "num_speculative_tokens": 2},
}


def structured() -> list[tuple[str, StructuredOutputsParams]]:
    out = [(name, StructuredOutputsParams(json=s)) for name, s in SCHEMAS.items()]
    out.append(("choice", StructuredOutputsParams(choice=CHOICES)))
    out.append(("regex", StructuredOutputsParams(regex=REGEX)))
    return out


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Each constraint on a prompt of its own, greedy and seeded at temperature 1."""
    prompts = mixed_prompts()
    out = []
    for i, (name, so) in enumerate(structured()):
        for temp in (0.0, 1.0):
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=temp, seed=7 + i, structured_outputs=so
            )
            out.append((f"{name}@{temp}", prompts[i % len(prompts)], params))
    return out


def check_output(name: str, text: str, finish_reason: str | None) -> None:
    """The output of constraint `name` is complete (ended by EOS) and valid."""
    assert finish_reason == "stop", (name, text, finish_reason)
    kind = name.split("@")[0]
    if kind == "choice":
        assert text in CHOICES, (name, text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), (name, text)
    else:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])


def run(llm: LLM, n_rounds: int = 1) -> list[list[tuple[int, ...]]]:
    """`n_rounds` rounds of the workload as one batch each; checks every output's validity and
    returns each round's tokens per request."""
    engine, tok = llm.engine, llm.engine.tokenizer
    out = []
    for r in range(n_rounds):
        ids = {}
        for name, prompt, params in workload():
            ids[name] = f"{r}-{name}"
            engine.add_request(ids[name], prompt, params)
        done = engine.drain()
        for name, req_id in ids.items():
            result = done[req_id]
            check_output(name, tok.decode(result.token_ids), result.finish_reason)
        out.append([tuple(done[ids[name]].token_ids) for name, _, _ in workload()])
    return out


@functools.cache
def alone(model: str | None) -> tuple[tuple[int, ...], ...]:
    """Each request alone (valid outputs checked too)."""
    requests = workload()
    outs = workloads.alone(model, SMALL, [(prompt, params) for _, prompt, params in requests])
    for (name, _, _), got in zip(requests, outs, strict=True):
        check_output(name, got.text, got.finish_reason)
    return tuple(tuple(o.token_ids) for o in outs)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_gives_valid_outputs_equal_to_alone_on_a_tiny_model(
    mode: str, gemma3: Path
) -> None:
    config = MODES[mode]
    llm = LLM(str(gemma3), **{**SMALL, **CHECKED, **config})
    n = 2 if "num_host_blocks" in config else 1  # the second round loads prefixes from the host
    assert run(llm, n) == [list(alone(str(gemma3)))] * n
    check_clean(llm)
    check_mode_effects(llm, config)


EMBEDDED_MODES = {  # its pool must hold one max-length request: a larger tight pool
    "depth1": MODES["depth1"],
    "depth3-drafts": MODES["depth3-drafts"],
    "tight-pool-preempts": {**TIGHT, "num_device_blocks": 120},
}


@pytest.mark.parametrize("mode", sorted(EMBEDDED_MODES))
def test_the_embedded_model_gives_valid_outputs_equal_to_alone(mode: str) -> None:
    llm = LLM(None, **{**SMALL, **CHECKED, **EMBEDDED_MODES[mode]})
    assert run(llm) == [list(alone(None))]
    check_clean(llm)
    if "num_device_blocks" in EMBEDDED_MODES[mode]:
        assert llm.engine.stats().num_preemptions > 0


def test_greedy_grammar_requests_beside_free_ones_leave_the_free_ones_alone(gemma3: Path) -> None:
    """A grammar request in the batch changes no other request's tokens (the mask is per row)."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(str(gemma3), **{**SMALL, **CHECKED, "async_depth": 3, "num_speculative_tokens": 2})
    expected = rounds(llm, mixed_prompts(), free, 1)
    engine = llm.engine
    for i, (_, prompt, params) in enumerate(workload()):
        engine.add_request(f"g{i}", prompt, params)
    for i, prompt in enumerate(mixed_prompts()):
        engine.add_request(f"f{i}", prompt, free)
    done = engine.drain()
    assert [[tuple(done[f"f{i}"].token_ids) for i in range(len(mixed_prompts()))]] == expected
    for i, (name, _, _) in enumerate(workload()):
        check_output(name, engine.tokenizer.decode(done[f"g{i}"].token_ids), "stop")


def test_max_tokens_cuts_a_grammar_request_with_finish_reason_length(gemma3: Path) -> None:
    schema = SCHEMAS["nested"]
    llm = LLM(str(gemma3), **SMALL)
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")


def test_json_object_gives_an_object(gemma3: Path) -> None:
    llm = LLM(str(gemma3), **SMALL)
    so = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=so)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an object's strings are unbounded: a random model may still be inside one
        assert out.text.startswith("{")


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (StructuredOutputsParams(json='{"type": "object"'), "not valid JSON"),
        (StructuredOutputsParams(json={"type": "frobnicate"}), "does not compile"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="start: foo"), "grammar"),
        (StructuredOutputsParams(json={"enum": ["x" * 70_000]}), "structured-outputs-max-spec"),
    ],
)
def test_a_spec_that_cannot_compile_is_a_value_error_and_queues_nothing(
    so: StructuredOutputsParams, words: str, gemma3: Path
) -> None:
    llm = LLM(str(gemma3), **SMALL)
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.engine.add_request("bad", [5, 6, 7], params)
    assert llm.engine.stats().num_requests == 0
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_with_structured_outputs_is_refused() -> None:
    so = StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=so)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
