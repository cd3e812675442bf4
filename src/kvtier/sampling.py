"""The two parameter sets a request's user-facing `SamplingParams` (engine/params.py) splits into
below the engine: `StopConditions`, the scheduler's (when a request ends, whether it drafts,
whether it may read the prefix cache), and `DrawParams`, the runner's and sampler's (how a token
is drawn, which logprobs come back). Both are checked at construction, naming the field.

Plain frozen data, no torch: the scheduler keeps `StopConditions` on its `Request` and carries
`DrawParams` to the runner in `NewRequestData` (sched/output.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.checks import check_bool, check_float, check_int, check_ints, check_strs, show

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
# What logprobs report, as vLLM's `logprobs_mode`: raw = the model's logits before any ban,
# temperature or filter (vLLM's default); processed = after them (filtered tokens are -inf).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match, as text: the cache key of its compiled grammar
    (model/grammar.py). `spec` is a JSON schema for "json", a regex, a JSON list of strings for
    "choice", an EBNF grammar for "grammar", empty for "json_object"."""

    kind: GrammarKind
    spec: str


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: constrain a request's output to exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a regex, one
    of a list of strings (`choice`) or an EBNF grammar (`grammar`, xgrammar's dialect of GBNF).
    Checked at construction; whether the engine can compile it is checked when a request
    carrying it is added (a ValueError naming the problem)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json must be a JSON schema, got {show(self.json)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {show(value)}")
        if self.choice is not None:
            choice = check_strs("structured_outputs.choice", self.choice)
            if not choice:
                raise ValueError("structured_outputs.choice must list at least one string")
            object.__setattr__(self, "choice", choice)
        if self.json_object is not None:
            check_bool("structured_outputs.json_object", self.json_object)

    def grammar_spec(self) -> GrammarSpec:
        """The spec as text (a schema dict as its JSON, key order kept: it orders the output)."""
        if self.json is not None:
            if isinstance(self.json, str):
                return GrammarSpec("json", self.json)
            try:
                return GrammarSpec("json", json.dumps(self.json, ensure_ascii=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_outputs.json is not JSON: {exc}") from None
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(list(self.choice), ensure_ascii=False))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        return GrammarSpec("json_object", "")


@dataclass(frozen=True, slots=True)
class StopConditions:
    """What ends a request and whether it speculates (the sampled values come from the runner)."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are ignored before this many outputs
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    use_ngram: bool = False  # propose draft tokens by prompt lookup (needs a scheduler with k > 0)
    skip_reading_prefix_cache: bool = False  # compute every prompt position (prompt logprobs)

    def __post_init__(self) -> None:
        """Type and range checks naming the field; lists become tuples, numpy ints ints."""
        put = object.__setattr__
        put(self, "max_tokens", check_int("max_tokens", self.max_tokens, lo=1))
        hint = f" (at most max_tokens={self.max_tokens})"
        put(self, "min_tokens", check_int("min_tokens", self.min_tokens, 0, self.max_tokens, hint))
        put(self, "stop_token_ids", check_ints("stop_token_ids", self.stop_token_ids, lo=0))
        if self.eos_token_id is not None:
            put(self, "eos_token_id", check_int("eos_token_id", self.eos_token_id, lo=0))
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("use_ngram", self.use_ngram)
        check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)


@dataclass(frozen=True)
class DrawParams:
    """How the sampler draws a request's tokens and which logprobs come back, named as vLLM's
    `SamplingParams` (the sampler takes any object with these attributes)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # top-n logprobs per sampled token; 0 = only the sampled token's
    prompt_logprobs: int | None = None  # top-n per prompt token (and the token's own); None: none
    grammar: GrammarSpec | None = None  # every output token must keep the output matching it
    # Adjustments of the logits before the draw (vLLM's semantics; model/adjust.py applies them):
    # presence and frequency over the output tokens, repetition over prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token may be drawn
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # last id banned after the others

    def __post_init__(self) -> None:
        """Type and range checks naming the field; numpy scalars are stored as int / float."""
        put = object.__setattr__
        greedy = " (0 = greedy)"
        put(self, "temperature", check_float("temperature", self.temperature, lo=0.0, hint=greedy))
        put(self, "top_k", check_int("top_k", self.top_k, lo=-1, hint=" (0 or -1 disables it)"))
        put(self, "top_p", check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        put(self, "min_p", check_float("min_p", self.min_p, lo=0.0, hi=1.0))
        if self.seed is not None:
            hint = " (None = unseeded)"
            put(self, "seed", check_int("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX, hint=hint))
        if self.logprobs is not None:
            put(self, "logprobs", check_int("logprobs", self.logprobs, lo=0))
        if self.prompt_logprobs is not None:
            n = check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hint=" (or None)")
            put(self, "prompt_logprobs", n)
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, check_float(name, getattr(self, name), lo=-2.0, hi=2.0))
        off = " (1 = off)"
        r = check_float(
            "repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True, hint=off
        )
        put(self, "repetition_penalty", r)
        put(self, "logit_bias", check_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = check_ints("allowed_token_ids", self.allowed_token_ids, lo=0)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty; send None to allow all")
            put(self, "allowed_token_ids", ids)
        words = tuple(
            check_ints(f"bad_words_token_ids[{i}]", w, lo=0)
            for i, w in enumerate(self.bad_words_token_ids)
        )
        if any(not w for w in words):
            raise ValueError("bad_words_token_ids must not hold an empty sequence; drop it")
        put(self, "bad_words_token_ids", words)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty, bias or allow/ban list changes this request's logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (needs token counts)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def check_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping (or (id, bias) pairs) as sorted pairs of int and finite float;
    TypeError / ValueError naming `logit_bias`."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    if isinstance(items, str | bytes) or not hasattr(items, "__iter__"):
        raise TypeError(f"logit_bias must be a {{token id: bias}} mapping, got {show(value)}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise TypeError(f"logit_bias must map token ids to numbers, got {show(item)}")
        token = check_int("logit_bias token id", item[0], lo=0)
        pairs[token] = check_float(f"logit_bias[{token}]", item[1])
    return tuple(sorted(pairs.items()))
