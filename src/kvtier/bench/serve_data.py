"""Workloads of `kvtier bench serve`: conversations of one (`random`) or several (`shared-prefix`)
rounds, as token ids when a tokenizer is known, else as text of common words."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Prompt = list[int] | str

_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find"
)
_WORDS = _TEXT.split()


@dataclass
class Conversation:
    """Rounds run in order; round r's prompt is round r-1's prompt + its answer + `questions[r]`
    (round 0's is `prefix + questions[0]`)."""

    index: int
    prefix: Prompt
    questions: list[Prompt]
    output_lens: list[int]
    start_delay: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


class Tok:
    """A `tokenizers` tokenizer: counts and encodes text, samples non-special token ids."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        self.path = file
        self.tok = Tokenizer.from_file(str(file))
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.ids = [i for i in range(self.tok.get_vocab_size()) if i not in special]

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def resolve_tokenizer(tokenizer: str | None, model: str) -> Tok | None:
    """--tokenizer (a folder or tokenizer.json; 'none' disables), else the model if it is a local
    folder (kvtier's embedded model for 'kvtier-default'), else None (counts come from usage)."""
    if tokenizer is not None:
        return None if tokenizer.lower() == "none" else Tok(Path(tokenizer))
    if Path(model, "tokenizer.json").is_file():
        return Tok(Path(model))
    if model == "kvtier-default":
        return Tok(Path(__file__).resolve().parent.parent / "model" / "default")
    return None


def _lens(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _prompt(rng: random.Random, n: int, tok: Tok | None, use_ids: bool) -> Prompt:
    if use_ids:
        assert tok is not None
        return [rng.choice(tok.ids) for _ in range(n)]
    return " " + " ".join(rng.choice(_WORDS) for _ in range(n))  # ≈ 1 token a word


@dataclass(frozen=True)
class Dataset:
    """What `build` generates: `random` (one round) or `shared-prefix` conversations."""

    dataset: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    seed: int = 0
    request_rate: float = float("inf")
    num_rounds: int = 1  # shared-prefix only
    num_prefixes: int = 1
    prefix_len: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Dataset:
        """The dataset `kvtier bench serve`'s flags describe."""
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__ if hasattr(args, f)})


def build(args: Dataset, tok: Tok | None, use_ids: bool) -> list[Conversation]:
    """The conversations of the workload, with Poisson start delays (all 0 for an infinite rate)."""
    rng = random.Random(args.seed)
    n, rounds = args.num_prompts, 1
    empty: Prompt = [] if use_ids else ""
    prefixes: list[Prompt] = [empty]
    if args.dataset == "shared-prefix":
        rounds = args.num_rounds
        prefixes = [
            _prompt(rng, args.prefix_len, tok, use_ids) for _ in range(max(1, args.num_prefixes))
        ]
    convs = []
    for i in range(n):
        qlens = _lens(rng, args.input_len, args.range_ratio, rounds)
        olens = _lens(rng, args.output_len, args.range_ratio, rounds)
        questions = [_prompt(rng, q, tok, use_ids) for q in qlens]
        convs.append(Conversation(i, prefixes[i % len(prefixes)], questions, olens))
    t, rate = 0.0, float(args.request_rate)
    for c in convs:
        c.start_delay = t
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return convs


def extend(history: Prompt, answer: str, tok: Tok | None) -> Prompt:
    """`history` + the answer text, in the prompt's form."""
    if isinstance(history, str):
        return history + answer
    assert tok is not None
    return history + tok.encode(answer)


def concat(a: Prompt, b: Prompt) -> Prompt:
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    assert isinstance(a, list) and isinstance(b, list)
    return a + b


def length(prompt: Prompt, tok: Tok | None) -> int | None:
    if isinstance(prompt, list):
        return len(prompt)
    return tok.count(prompt) if tok is not None else None
