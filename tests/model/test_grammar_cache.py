"""`Grammars`' cache as the engine uses it off its thread: a spec compiled by `compile_async`
is compiled once however many wait for it, and a held spec survives evictions until released."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import kvtier.model.grammar as grammar_module
from kvtier.config import StructuredOutputsConfig
from kvtier.engine.params import DEFAULT_MODEL
from kvtier.model import load_tokenizer
from kvtier.model.grammar import Grammars
from kvtier.sampling import GrammarSpec

A = GrammarSpec("regex", "a+")
B = GrammarSpec("regex", "b+")


def _grammars(cache_size: int = 256) -> Grammars:
    tok = load_tokenizer(DEFAULT_MODEL)
    config = StructuredOutputsConfig(structured_outputs_cache_size=cache_size)
    return Grammars(tok, tok.vocab_size, [], config)


def test_waiters_for_one_spec_share_one_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = grammar_module._compile

    def held(tokenizer: Any, spec: GrammarSpec) -> Any:
        assert gate.wait(60), "never released"
        return real(tokenizer, spec)

    monkeypatch.setattr(grammar_module, "_compile", held)
    g = _grammars()
    first, second = g.compile_async(A), g.compile_async(A)
    assert first is second and not first.done()
    gate.set()
    first.result(timeout=60)
    assert g.num_compiles == 1
    assert g.compile_async(A).done()  # a hit: done at once, nothing compiled again
    g.compile(A)
    assert g.num_compiles == 1


def test_a_held_spec_is_never_evicted_until_released() -> None:
    g = _grammars(cache_size=1)
    g.hold(A)
    g.compile_async(A).result(timeout=60)
    g.compile(B)  # over the bound: B, unheld, is the one that goes
    g.compile(A)
    assert g.num_compiles == 2 and g.num_cached == 1
    g.release(A)
    assert g.num_held == 0
    g.compile(B)
    assert g.num_compiles == 3


def test_a_spec_over_the_size_limit_is_refused_before_any_compile() -> None:
    tok = load_tokenizer(DEFAULT_MODEL)
    config = StructuredOutputsConfig(structured_outputs_max_spec_bytes=3)
    g = Grammars(tok, tok.vocab_size, [], config)
    with pytest.raises(ValueError, match="max-spec-bytes"):
        g.compile_async(GrammarSpec("regex", "abcd"))
    assert g.num_compiles == 0
