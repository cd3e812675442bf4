"""User-facing `SamplingParams` (vLLM's names) and `EngineArgs`; both split into the narrower
parameter sets of the scheduler (stop conditions) and the sampler (how to draw)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.config import PROTECTIONS, CacheConfig, SchedulerConfig, parse_protect
from kvtier.model.sampler import LOGPROBS_MODES
from kvtier.model.sampler import SamplingParams as DrawParams
from kvtier.sched.request import SamplingParams as StopParams

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "model" / "default"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop, as vLLM spells it."""

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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        self.draw_params()  # validates temperature, top_p, top_k, min_p, logprobs
        StopParams(max_tokens=self.max_tokens, min_tokens=self.min_tokens)
        n = self.prompt_logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer ≥ 0, got {n!r}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def draw_params(self) -> DrawParams:
        return DrawParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            logprobs=self.logprobs,
        )

    def stop_params(self, eos_token_id: int | None, use_ngram: bool) -> StopParams:
        return StopParams(
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
    logprobs_mode: str = "raw_logprobs"  # as vLLM's: raw_/processed_ + logprobs/logits
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "sim", "cuda"):
            raise ValueError(f"device must be cpu, sim or cuda, got {self.device!r}")
        if self.sanitize not in (None, True, False, "raise", "collect"):
            raise ValueError(
                f"sanitize must be True, False, 'raise' or 'collect', got {self.sanitize!r}"
            )
        bad = sorted(set(self.protect) - set(PROTECTIONS))
        if bad:
            raise ValueError(f"unknown protections {bad}; choose from {PROTECTIONS} (or none)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be ≥ 0")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """Flat vLLM-style keywords (block_size=…, max_num_seqs=…) → nested configs."""
        cache_names = {f.name for f in fields(CacheConfig)}
        sched_names = {f.name for f in fields(SchedulerConfig)}
        own = {f.name for f in fields(cls)} - {"cache", "scheduler"}
        unknown = sorted(set(kwargs) - cache_names - sched_names - own)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}")
        cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_names})
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_names})
        rest = {k: v for k, v in kwargs.items() if k in own}
        if isinstance(rest.get("protect"), str):
            rest["protect"] = parse_protect(rest["protect"])
        return cls(model=model, cache=cache, scheduler=sched, **rest)
