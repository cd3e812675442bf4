"""The offline `LLM` compiles a batch's grammars on workers before it queues any request: distinct
specs compile at once, and a refused batch leaves no grammar held."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

import kvtier.model.grammar as grammar_module
from kvtier.engine import LLM, SamplingParams, StructuredOutputsParams
from kvtier.sampling import GrammarSpec

HANG_GUARD_S = 60.0
SCHEMAS = [
    {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]},
]


def test_a_batch_compiles_its_distinct_grammars_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    both = threading.Barrier(2, timeout=HANG_GUARD_S)  # one after the other: broken, refused
    real = grammar_module._compile

    def compile_together(tokenizer: Any, spec: GrammarSpec) -> Any:
        both.wait()
        return real(tokenizer, spec)

    monkeypatch.setattr(grammar_module, "_compile", compile_together)
    llm = LLM(None, max_model_len=128, structured_outputs_compile_timeout_s=3600.0)
    params = [
        SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=s))
        for s in SCHEMAS
    ]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.grammars.num_compiles == 2 and llm.engine.grammars.num_held == 0
    llm.engine.close()


def test_a_refused_batch_holds_no_grammar() -> None:
    llm = LLM(None, max_model_len=128, structured_outputs_max_spec_bytes=64)
    ok = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    big = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="b" * 99))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[x"))
    for second in (big, bad):  # refused when prepared, and when added
        with pytest.raises(ValueError, match=r"max-spec-bytes|does not compile"):
            llm.generate([{"prompt_token_ids": [5, 6]}] * 2, [ok, second], use_tqdm=False)
        assert llm.engine.grammars.num_held == 0
        assert not llm.engine.has_unfinished_requests()
    llm.engine.close()
