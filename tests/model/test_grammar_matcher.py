"""A request's `Matcher` (model/grammar.py): a token the grammar refuses changes nothing and
leaves the matcher usable; EOS only where the grammar accepts; a rollback undoes free tokens
first, then the grammar's."""

from __future__ import annotations

from kvtier.engine.params import DEFAULT_MODEL
from kvtier.model import load_tokenizer
from kvtier.model.grammar import Grammars, Matcher
from kvtier.sampling import GrammarSpec

EOS = 1


def _ids(text: str) -> list[int]:
    return load_tokenizer(DEFAULT_MODEL).encode(text, add_special_tokens=False)


def _matcher(regex: str) -> Matcher:
    tok = load_tokenizer(DEFAULT_MODEL)
    return Grammars(tok, tok.vocab_size, [EOS]).matcher(GrammarSpec("regex", regex), [])


def test_a_refused_token_changes_nothing_and_the_next_one_is_judged_from_the_same_place() -> None:
    (a,), (b,), (z,) = _ids("a"), _ids("b"), _ids("z")
    m = _matcher("ab")
    assert m.accept(a)
    assert not m.accept(z)
    assert m.constrained and m.num_free == 0
    assert not m.accept(EOS)  # "a" alone does not match
    assert m.accept(b) and m.accept(EOS)
    assert not m.constrained and m.num_free == 1


def test_a_rollback_undoes_free_tokens_first() -> None:
    (a,), (b,), (z,) = _ids("a"), _ids("b"), _ids("z")
    m = _matcher("ab")
    m.accept_free([a, b, EOS, z])  # past its end: free
    assert m.num_free == 2
    m.rollback(3)  # z, EOS, then "b"
    assert m.constrained and not m.accept(z) and m.accept(b)
