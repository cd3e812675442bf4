"""The offline `LLM` API, shaped like vLLM's: `LLM(model=None, **engine_args).generate(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from kvtier.checks import show
from kvtier.engine.core import EngineCore
from kvtier.engine.params import EngineArgs, SamplingParams, check_request
from kvtier.engine.prompts import encode_prompt
from kvtier.engine.requests import FinishedRequest
from kvtier.sched.output import TokenLogprobs

PromptType = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per position
    # {prompt token: its logprob, then the top candidates: theirs} (vLLM's shape, floats).
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    """Offline batch generation. `model=None` loads the embedded default model."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = EngineCore(EngineArgs.from_kwargs(model, **engine_args))
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or {"prompt_token_ids": [...]}); outputs keep order.

        The batch is accepted or refused as a whole: every prompt is checked before any is
        queued, and if queueing one still fails, those queued by this call are aborted (the
        error, a TypeError or ValueError, names the field)."""
        items = _as_list(prompts, "prompts", (str, dict), "a string or a dict")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _as_list(sampling_params, "sampling_params", SamplingParams, "a SamplingParams")
        if isinstance(sampling_params, SamplingParams):
            params *= len(items)
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise TypeError(
                f"priority must be a list of integers, one per prompt, got {show(priority)}"
            )
        priorities = [0] * len(items) if priority is None else list(priority)
        for name, values in (("sampling_params", params), ("priority", priorities)):
            if len(values) != len(items):
                raise ValueError(f"{len(values)} {name} for {len(items)} prompts; give one each")
        engine = self.engine
        vocab_size = engine.model_config.vocab_size
        batch: list[tuple[str, str | None, list[int], SamplingParams, int]] = []
        for i, (item, p, prio) in enumerate(zip(items, params, priorities, strict=True)):
            prompt = encode_prompt(
                engine.tokenizer, item, vocab_size=vocab_size, name=f"prompts[{i}]"
            )
            text, tokens = prompt.text, prompt.token_ids
            try:
                tokens = check_request(
                    tokens,
                    p,
                    prio,
                    vocab_size=vocab_size,
                    max_logprobs=engine.args.max_logprobs,
                )
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
            batch.append((f"gen-{self._counter + i}", text, tokens, p, prio))
        self._counter += len(batch)
        try:  # the batch's grammars compile on workers at once; each add then hits the cache
            compiling = [engine.prepare_request(r, t, p, prio) for r, _, t, p, prio in batch]
            futures.wait([f for f in compiling if f is not None])
            for req_id, _, tokens, p, prio in batch:
                engine.add_request(req_id, tokens, p, prio)
        except BaseException:
            self._discard([req_id for req_id, *_ in batch])  # added or only prepared
            raise
        bar = _progress(len(batch)) if use_tqdm else None
        done: dict[str, FinishedRequest] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.result is not None:
                    done[out.req_id] = out.result
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [_output(done[req_id], text) for req_id, text, _, _, _ in batch]

    def _discard(self, req_ids: list[str]) -> None:
        """Abort requests this call prepared or queued (still waiting: they hold no blocks)."""
        for req_id in req_ids:
            self.engine.abort(req_id)


def _output(result: FinishedRequest, prompt: str | None) -> RequestOutput:
    """vLLM's shape of a finished request."""
    logprobs = result.logprobs
    completion = CompletionOutput(
        index=0,
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        logprobs=logprobs,
        cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs else None,
    )
    return RequestOutput(
        result.req_id,
        prompt,
        result.prompt_token_ids,
        [completion],
        True,
        result.num_cached_tokens,
        prompt_logprobs_dicts(result.prompt_logprobs, result.prompt_token_ids),
    )


def prompt_logprobs_dicts(
    logprobs: list[TokenLogprobs | None] | None, prompt_token_ids: list[int]
) -> list[dict[int, float] | None] | None:
    """vLLM's prompt_logprobs shape: per position None (the first) or {token: logprob, **top}."""
    if logprobs is None:
        return None
    return [
        None if lp is None else {tok: lp.logprob} | lp.top
        for tok, lp in zip(prompt_token_ids, logprobs, strict=True)
    ]


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - tqdm ships with the dependencies
        return None
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)


def _as_list(value: Any, name: str, kind: Any, what: str) -> list[Any]:
    """One `kind` or a list / tuple of them as a list; TypeError naming `name` otherwise."""
    if isinstance(value, kind):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be {what} or a list of them, got {show(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] must be {what}, got {show(item)}")
    return list(value)
