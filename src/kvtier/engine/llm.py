"""The offline `LLM` API, shaped like vLLM's: `LLM(model=None, **engine_args).generate(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.core import EngineCore
from kvtier.engine.params import EngineArgs, SamplingParams
from kvtier.runner.logprobs import TokenLogprobs

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
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or {"prompt_token_ids": [...]}); outputs keep order."""
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        engine = self.engine
        ids: list[str] = []
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for item, p in zip(items, params, strict=True):
            text, tokens = self._tokens(item)
            req_id = f"gen-{self._counter}"
            self._counter += 1
            engine.add_request(req_id, tokens, p)
            ids.append(req_id)
            texts.append(text)
            token_lists.append(tokens)
        bar = _progress(len(ids)) if use_tqdm else None
        done = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done += 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self._output(r, t, tok) for r, t, tok in zip(ids, texts, token_lists, strict=True)]

    def _tokens(self, item: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(item, str):
            return item, self.engine.tokenizer.encode(item)
        if isinstance(item, dict) and "prompt_token_ids" in item:
            return item.get("prompt"), [int(t) for t in item["prompt_token_ids"]]
        if isinstance(item, dict) and "prompt" in item:
            return item["prompt"], self.engine.tokenizer.encode(item["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _output(self, req_id: str, prompt: str | None, tokens: list[int]) -> RequestOutput:
        state = self.engine.requests.pop(req_id)
        logprobs = state.logprobs if state.params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=state.detok.text,
            token_ids=list(state.token_ids),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs else None,
        )
        return RequestOutput(
            req_id,
            prompt,
            tokens,
            [completion],
            True,
            state.request.num_cached_tokens,
            prompt_logprobs_dicts(state.prompt_logprobs, tokens),
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
