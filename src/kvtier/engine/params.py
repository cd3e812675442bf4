"""User-facing `SamplingParams` (vLLM's names) and `EngineArgs`. A request's `SamplingParams`
splits into the narrower sets of `kvtier.sampling`: `StopConditions` for the scheduler and
`DrawParams` for the runner and its sampler."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import Any

from kvtier.checks import (
    check_bool,
    check_field_types,
    check_int,
    check_ints,
    check_strs,
    flag,
    show,
    show_ids,
)
from kvtier.config import (
    PROTECTIONS,
    QUANTIZATIONS,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    parse_protect,
)
from kvtier.engine.prompts import check_prompt_ids
from kvtier.sampling import (
    LOGPROBS_MODES,
    DrawParams,
    StopConditions,
    StructuredOutputsParams,
    check_logit_bias,
)
from kvtier.sched.queues import POLICIES

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "model" / "default"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop, as vLLM spells it. Checked at construction: a wrong type
    is a TypeError, a value out of range a ValueError, each naming the field; lists are stored as
    tuples and numpy scalars as int / float. Limits that depend on the engine (token ids below
    the vocabulary size, logprobs and prompt_logprobs ≤ max_logprobs) are checked by
    `EngineCore.add_request`."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-n per prompt token (and the token's own); no cache
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # constrain the output to a JSON schema, regex, choice or grammar (`kvtier.sampling`)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's semantics: presence and frequency over output tokens, repetition over prompt and
    # output tokens (1 = off); logit_bias adds to a token's logit; allowed_token_ids keeps only
    # those; each bad word's last token is banned where its other tokens were just output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # {token id: bias} (or (id, bias) pairs), stored as sorted pairs so the params stay hashable
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.stop_token_ids is not None:
            put(self, "stop_token_ids", check_ints("stop_token_ids", self.stop_token_ids))
        stop = self.stop_conditions(None, False)  # checks max_tokens, min_tokens
        names = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "logprobs",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "allowed_token_ids",
        )
        draw = DrawParams(  # checks them
            **{name: getattr(self, name) for name in names},
            logit_bias=check_logit_bias(self.logit_bias),
        )
        for name in ("max_tokens", "min_tokens"):
            put(self, name, getattr(stop, name))
        for name in names:
            put(self, name, getattr(draw, name))
        if self.logit_bias is not None:
            put(self, "logit_bias", draw.logit_bias)
        if self.bad_words is not None:
            put(self, "bad_words", check_strs("bad_words", self.bad_words))
        if self.stop is not None:
            strs = check_strs("stop", self.stop)
            put(self, "stop", self.stop if isinstance(self.stop, str) else strs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))
        if self.prompt_logprobs is not None:
            n = check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hint=" (or None)")
            put(self, "prompt_logprobs", n)
        self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a kvtier.sampling.StructuredOutputsParams, got "
                f"{show(so)}"
            )
        if self.min_tokens:
            # the grammar alone decides where the output may end: EOS banned while the grammar
            # allows nothing else would leave no token to draw
            raise ValueError(
                f"min_tokens={self.min_tokens} cannot be combined with structured_outputs: the "
                "grammar decides where the output ends; drop min_tokens"
            )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return check_strs("stop", self.stop)

    def draw_params(self, bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> DrawParams:
        """How the sampler draws this request's tokens, which logprobs come back;
        `bad_words_token_ids`: `bad_words` tokenized (`engine/prompts.py` `bad_words_token_ids`)."""
        so = self.structured_outputs
        return DrawParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            grammar=None if so is None else so.grammar_spec(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias or (),  # type: ignore[arg-type]
            allowed_token_ids=self.allowed_token_ids,  # type: ignore[arg-type]
            bad_words_token_ids=bad_words_token_ids,
        )

    def stop_conditions(self, eos_token_id: int | None, use_ngram: bool) -> StopConditions:
        """When the scheduler ends this request (with the model's EOS), whether it drafts."""
        return StopConditions(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            eos_token_id=eos_token_id,
            ignore_eos=self.ignore_eos,
            use_ngram=use_ngram,
            skip_reading_prefix_cache=self.prompt_logprobs is not None,
        )


@dataclass(frozen=True)
class EngineArgs:
    """Engine construction arguments, named as vLLM's where the meaning is the same."""

    model: str | None = None  # local HF folder; None = the embedded default model
    dtype: str = "auto"  # float32, bfloat16, float64, or auto (the checkpoint's)
    # int8 weights: "compressed-tensors", "int8" or "w8a8" (model/loader.py); None: config.json's
    quantization: str | None = None
    device: str = "cpu"  # cpu, sim (virtual device + sanitizer), cuda
    seed: int = 0
    num_speculative_tokens: int = 0  # n-gram (prompt lookup) drafts per step
    protect: tuple[str, ...] = PROTECTIONS  # block-lifetime protections in force
    # Race sanitizer: True/"raise" stops at the first hazard, "collect" counts them (benchmarks);
    # default: raise on sim, off elsewhere.
    sanitize: bool | str | None = None
    poison: bool = False  # fill recycled blocks with NaN (debug)
    check_integrity: bool = False  # check the KV pool after every step (debug)
    policy: str = "fcfs"  # or "priority"
    long_prefill_token_threshold: int = 0
    max_logprobs: int = 20  # most logprobs a request may ask for (as vLLM's default)
    # torch's kernel threads; None: the usable cores but one, left to the host (engine/threads.py)
    torch_threads: int | None = None
    logprobs_mode: str = "raw_logprobs"  # as vLLM's: raw_/processed_ + logprobs/logits
    # Record KV cache events in every tier for `EngineCore.take_kv_events`, which the caller must
    # drain (kvtier serve sets it from --kv-events-config); needs prefix caching.
    enable_kv_cache_events: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        if isinstance(self.model, PathLike):
            object.__setattr__(self, "model", str(Path(self.model)))
        check_field_types(self)
        if self.device not in ("cpu", "sim", "cuda"):
            raise ValueError(f"--device must be cpu, sim or cuda, got {self.device!r}")
        if self.sanitize not in (None, True, False, "raise", "collect"):
            raise ValueError(
                f"sanitize must be True, False, 'raise' or 'collect', got {self.sanitize!r}"
            )
        bad = sorted(set(self.protect) - set(PROTECTIONS))
        if bad:
            raise ValueError(f"unknown protections {bad}; choose from {PROTECTIONS} (or none)")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("num_speculative_tokens", "long_prefill_token_threshold", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({flag(name)}) must be ≥ 0, got {getattr(self, name)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization (--quantization) must be one of {QUANTIZATIONS} or unset (the "
                f"checkpoint's config.json), got {self.quantization!r}"
            )
        if self.torch_threads is not None and not 1 <= self.torch_threads <= 1024:
            raise ValueError(f"--torch-threads must be in 1..1024, got {self.torch_threads}")
        if self.enable_kv_cache_events and not self.cache.enable_prefix_caching:
            raise ValueError(
                "KV cache events (--kv-events-config) report the prefix cache, which "
                "--no-enable-prefix-caching turns off: enable prefix caching or drop the events"
            )

    def check_model(self, model: ModelConfig) -> None:
        """ValueError naming the flag for what `model` cannot honour: a max_model_len beyond its
        max_position_embeddings (positions it was never trained on: vLLM refuses these too), or
        more drafts per step than a request could ever use."""
        limit = model.max_position_embeddings
        max_len = self.scheduler.max_model_len
        if max_len is not None and max_len > limit:
            raise ValueError(
                f"max_model_len (--max-model-len) {max_len} exceeds the model's "
                f"max_position_embeddings={limit} ({model.source}): positions past it were never "
                f"trained and give wrong output; set --max-model-len ≤ {limit} or leave it unset"
            )
        k = self.num_speculative_tokens
        if k >= (max_len or limit):
            raise ValueError(
                f"num_speculative_tokens (--num-speculative-tokens) {k} must be below "
                f"max_model_len={max_len or limit}; a request never has room for more drafts"
            )

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """Flat vLLM-style keywords (block_size=…, max_num_seqs=…) → nested configs."""
        cache_names = {f.name for f in fields(CacheConfig)}
        sched_names = {f.name for f in fields(SchedulerConfig)}
        so_names = {f.name for f in fields(StructuredOutputsConfig)}
        own = {f.name for f in fields(cls)} - {"cache", "scheduler", "structured_outputs"}
        unknown = sorted(set(kwargs) - cache_names - sched_names - so_names - own)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}")
        cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_names})
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_names})
        so = StructuredOutputsConfig(**{k: v for k, v in kwargs.items() if k in so_names})
        rest = {k: v for k, v in kwargs.items() if k in own}
        if isinstance(rest.get("protect"), str):
            rest["protect"] = parse_protect(rest["protect"])
        return cls(model=model, cache=cache, scheduler=sched, structured_outputs=so, **rest)


def check_request(
    prompt_token_ids: object,
    params: object,
    priority: object,
    *,
    vocab_size: int,
    max_logprobs: int,
) -> list[int]:
    """The checks of a request that need the engine's limits, before anything is recorded:
    returns the prompt as a list of ints; TypeError / ValueError naming the field otherwise."""
    tokens = check_prompt_ids(prompt_token_ids, vocab_size)
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"sampling_params must be a kvtier.engine.SamplingParams, got {show(params)}"
        )
    named = {
        "stop_token_ids": params.stop_token_ids or (),
        "allowed_token_ids": params.allowed_token_ids or (),
        "logit_bias": [t for t, _ in params.logit_bias or ()],  # type: ignore[misc]
    }
    for name, ids in named.items():
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{name} {show_ids(bad)} are outside the vocabulary [0, {vocab_size}); "
                "drop them or use this model's token ids"
            )
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is not None and n > max_logprobs:
            raise ValueError(
                f"{name}={n} exceeds this engine's max_logprobs={max_logprobs}; ask for fewer "
                "or start the engine with a larger max_logprobs"
            )
    check_int("priority", priority, hint=" (lower runs first under the priority policy)")
    return tokens
