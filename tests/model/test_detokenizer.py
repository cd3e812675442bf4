"""Incremental detokenizer: deltas add up to the full decode, partial UTF-8 waits, stop strings
cut the text (also when split across tokens)."""

from __future__ import annotations

import pytest

from kvtier.model.detokenizer import IncrementalDetokenizer
from kvtier.model.tokenizer import load_tokenizer


@pytest.fixture
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir("llama"))


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids]


def test_deltas_add_up_and_multibyte_characters_wait(tok):
    text = "naïve → ünïcode 日本"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Q:"))
    deltas = feed(detok, ids)
    assert "".join(deltas) == detok.text == text
    assert "" in deltas  # a byte of a multi-byte character produced no text yet
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_the_text(tok):
    ids = tok.encode("the end. more text", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["end."])
    feed(detok, ids)
    assert detok.text == "the "
    assert detok.stop_reason == "end."
    assert detok.push(ids[0]) == ""  # finished: later tokens add nothing


def test_stop_string_kept_when_asked_and_earliest_wins(tok):
    ids = tok.encode("abc STOP def HALT", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["HALT", "STOP"], include_stop_str_in_output=True)
    feed(detok, ids)
    assert detok.text == "abc STOP"
    assert detok.stop_reason == "STOP"


def test_special_tokens_skipped(tok):
    detok = IncrementalDetokenizer(tok)
    feed(detok, [*tok.encode("hi", add_special_tokens=False), 2])
    assert detok.text == "hi"
