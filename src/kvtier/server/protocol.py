"""OpenAI request bodies (pydantic, strict, unknown fields rejected as OpenAI does) and their
translation to `SamplingParams`; OpenAI-shaped error bodies. No engine access here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.engine.params import SamplingParams


class APIError(Exception):
    """An error the client caused (or the server's state): rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions (sent via extra_body)."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise APIError(f"{name} is not supported by this server; omit it", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises APIError (400) for values `SamplingParams` rejects."""
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
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
    logprobs: int | None = Field(default=None, ge=0, le=20)
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
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
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
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# Used when the tokenizer config has no chat template: one "role: text" line per message.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def render_default_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """DEFAULT_CHAT_TEMPLATE without jinja2."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


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
    return APIError(f"Invalid value for '{param}': {err.get('msg', 'invalid')}.", param=param)
