"""OpenAI request bodies (pydantic, strict, unknown fields rejected as OpenAI does) and their
translation to `SamplingParams`; OpenAI-shaped error bodies; strict JSON rendering (no NaN or
Infinity, no lone surrogates). No engine access here."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvtier.engine.params import SamplingParams

# vLLM's floor for a logprob: -inf (a token the filters removed) renders as this finite value.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """`value` if finite, else MIN_LOGPROB (JSON has no -Infinity; NaN never is a logprob)."""
    return value if math.isfinite(value) else MIN_LOGPROB


def _valid_text(text: str) -> str:
    """`text` with lone UTF-16 surrogates (which UTF-8 cannot carry) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def dumps(obj: Any) -> str:
    """Strict JSON: ValueError on NaN or ±Infinity (values must be made finite before)."""
    return _valid_text(json.dumps(obj, ensure_ascii=False, allow_nan=False))


class JSONBody(JSONResponse):
    """The server's JSON responses, rendered by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def check_text(value: Any, param: str) -> None:
    """APIError (400) naming the first string under `value` (keys included) that UTF-8 cannot
    encode (a lone surrogate such as "\\ud800"); `param` is the path of `value`."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                f"Invalid value for '{param}': a lone UTF-16 surrogate is not valid text; "
                "send well-formed Unicode.",
                param=param,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{param}.{key}" if param else str(key)
            check_text(key, path)
            check_text(item, path)
    elif isinstance(value, list):
        # token-id lists are long: only lists that hold text need a look
        for i, item in enumerate(value):
            if isinstance(item, str | list | dict):
                check_text(item, f"{param}.{i}")


class APIError(Exception):
    """An error the client caused (or the server's state): rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.message, self.status, self.param, self.code, self.kind = (
            message,
            status,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": error | {"code": self.code}}

    def response(self) -> JSONBody:
        return JSONBody(self.body(), status_code=self.status, headers=self.headers)


# Bounds on what one request may ask of the engine (each refused with a 400 naming the field).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 32  # choices per prompt
INT64 = 2**63


class _Body(BaseModel):
    # JSON's NaN / Infinity literals (Python's parser accepts them) are refused in every field
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions (sent via extra_body)."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def check_unsupported(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters long", param="stop"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options can only be given with stream=true", param="stream_options"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise APIError(f"{name} is not supported by this server; omit it", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        index: int = 0,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Parameters of choice `index` of a prompt (a seeded request's choice i draws with
        seed + i, as vLLM's parallel sampling). Raises APIError (400) for values
        `SamplingParams` rejects."""
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": None if self.seed is None else self.seed + index,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError("only best_of=1 is supported", param="best_of")

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... pass through

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def dict_messages(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: role and the content's text."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: as /v1/completions and /v1/chat/completions would tokenize the prompt
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def validation_error(errors: list[Any]) -> APIError:
    """A pydantic error list → one 400 naming the first offending field, as OpenAI words it."""
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param)
    if err.get("type") == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param)
    if err.get("type") == "json_invalid":
        return APIError("We could not parse the JSON body of your request.", param=None)
    if param is None:
        return APIError(f"Invalid request body: {err.get('msg', 'invalid')}.")
    return APIError(f"Invalid value for '{param}': {err.get('msg', 'invalid')}.", param=param)
