"""Incremental detokenizer: deltas add up to the full decode, partial UTF-8 waits, stop strings
cut the text (also when split across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.model.detokenizer import IncrementalDetokenizer
from kvtier.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
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


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Deltas as the engine sends them: one per token, then what the finish releases."""
    return [detok.push(t) for t in ids] + [detok.flush()]


def test_a_possible_stop_string_start_is_held_back_until_it_cannot_match(tok):
    ids = tok.encode("abXYq then abXYZ!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["XYZ"])
    deltas = [detok.push(t) for t in ids]
    assert deltas[:5] == ["a", "b", "", "", "XYq"]  # "X", "XY" could start "XYZ": held
    assert "".join(deltas) == detok.text == "abXYq then ab"
    assert detok.stop_reason == "XYZ" and detok.flush() == ""


def test_held_back_text_is_released_when_the_request_ends(tok):
    detok = IncrementalDetokenizer(tok, stop=["XYZ", "Q"])
    deltas = stream(detok, tok.encode("abXY", add_special_tokens=False))
    assert deltas == ["a", "b", "", "", "XY"]
    assert detok.stop_reason is None and "".join(deltas) == detok.text == "abXY"


def test_stop_strings_only_match_past_min_tokens(tok):
    """As vLLM: a stop string must end in the text of an output token after the first
    `min_tokens`; it may begin earlier."""
    ids = tok.encode("STOP STOP", add_special_tokens=False)
    early = IncrementalDetokenizer(tok, stop=["STOP"], min_tokens=4)
    assert "".join(stream(early, ids)) == early.text == "STOP "
    late = IncrementalDetokenizer(tok, stop=["STOP"], min_tokens=3)  # 4th token ends it
    assert "".join(stream(late, ids)) == late.text == ""
    assert late.stop_reason == "STOP"
    never = IncrementalDetokenizer(tok, stop=["STOP"], min_tokens=9)
    assert "".join(stream(never, ids)) == never.text == "STOP STOP"


STOP_CHARS = "abX"
CHAR_IDS = {c: i + 3 for c, i in zip(STOP_CHARS, STOP_CHARS.encode(), strict=True)}
# Bytes of "é" as separate tokens (a lone byte decodes to U+FFFD), next to plain characters.
token_st = st.sampled_from([*CHAR_IDS.values(), 0xC3 + 3, 0xA9 + 3])
stops_st = st.lists(st.text(STOP_CHARS, min_size=1, max_size=4), min_size=1, max_size=3)


@given(
    ids=st.lists(token_st, max_size=24),
    stops=stops_st,
    min_tokens=st.integers(0, 6),
    include=st.booleans(),
)
def test_streamed_text_is_always_a_prefix_of_the_final_text(
    tok, ids: list[int], stops: list[str], min_tokens: int, include: bool
) -> None:
    detok = IncrementalDetokenizer(
        tok, stops, include_stop_str_in_output=include, min_tokens=min_tokens
    )
    streamed = ""
    for t in ids:
        streamed += detok.push(t)
        assert detok.text.startswith(streamed)  # nothing sent that the final text drops
        if detok.stop_reason is None:  # held back: at most the longest stop less one character
            assert len(detok.text) - len(streamed) <= max(map(len, stops)) - 1
    streamed += detok.flush()
    assert streamed == detok.text


@given(
    chars=st.text(STOP_CHARS, max_size=24),
    stops=stops_st,
    min_tokens=st.integers(0, 6),
    include=st.booleans(),
)
def test_the_final_text_ends_at_the_first_stop_that_ends_past_min_tokens(
    tok, chars: str, stops: list[str], min_tokens: int, include: bool
) -> None:
    """One character per token: the stop that ends first (after the first `min_tokens`
    characters; the longest of those ending together) cuts the text."""
    detok = IncrementalDetokenizer(
        tok, stops, include_stop_str_in_output=include, min_tokens=min_tokens
    )
    streamed = "".join(stream(detok, [CHAR_IDS[c] for c in chars]))
    found = [
        (i + len(s), i, s)
        for s in stops
        for i in range(len(chars))
        if chars.startswith(s, i) and i + len(s) > min_tokens
    ]
    if not found:
        assert (streamed, detok.stop_reason) == (chars, None)
        return
    end, start, stop = min(found)
    assert detok.stop_reason == stop
    assert streamed == detok.text == chars[: end if include else start]
