"""OpenAI request bodies with vLLM's extensions (pydantic, strict types; unknown fields ignored
with one warning per name, as vLLM does, unless they would change the answer) and their
translation to `SamplingParams`. A body's faults are `APIError`s (`errors.py` renders them). No
engine access here."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.engine.params import SamplingParams
from kvtier.sampling import StructuredOutputsParams
from kvtier.server.errors import APIError
from kvtier.server.fields import CHAT_NEUTRAL, COMPLETION_NEUTRAL, NEUTRAL, unsupported_field

# Bounds on what one request may ask of the engine (each refused with a 400 naming the field).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 32  # choices per prompt
INT64 = 2**63
# The most token entries one response may carry, counted before anything runs: every choice's
# max_tokens × (1 + logprobs), plus its echoed or scored prompt tokens × (1 + prompt_logprobs).
# An entry renders as tens of bytes of JSON, so this bounds what the HTTP process builds for one
# request to tens of MB (listed in docs/serving.md).
MAX_RESPONSE_TOKENS = 1 << 21
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BAD_WORDS = 128
MAX_ALLOWED_TOKEN_IDS = 1 << 18
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bounds; vLLM clamps a bias into them


class _Body(BaseModel):
    # JSON's NaN / Infinity literals (Python's parser accepts them) are refused in every field;
    # unknown fields are kept aside (`model_extra`) for `check_extras`
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def extras(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class JSONSchemaFormat(_Body):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # enforced either way (as vLLM): the output follows the schema


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's options of `structured_outputs` this engine honours as they are: whitespace is never
# free in its JSON (as vLLM's disable_any_whitespace), and it has one backend
STRUCTURED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "disable_any_whitespace": (None, True, False),
    "disable_fallback": (None, True, False),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


class _Sampling(_Body):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions (sent via extra_body)."""

    model: str | None = None  # vLLM: the served model when absent
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # honoured under --scheduling-policy priority, else ignored (as vLLM)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's penalties and bias, vLLM's repetition penalty, bad words and allowed ids
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    allowed_token_ids: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = NEUTRAL

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the output is constrained to, from whichever field asked; APIError (400) when
        more than one did or one is malformed. (Whether it compiles is the engine's 400.)"""
        asked: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    "response_format of type json_schema needs json_schema.schema; send "
                    '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                    param="response_format.json_schema",
                )
            asked.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            check_extras(so.extras(), STRUCTURED_NEUTRAL)
            kw: dict[str, Any] = {"json": so.json_, "regex": so.regex, "choice": so.choice}
            kw |= {"grammar": so.grammar, "json_object": so.json_object}
            asked.append(("structured_outputs", {k: v for k, v in kw.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                asked.append((f"guided_{name}", {name: value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = [n for n, _ in asked]
            raise APIError(
                f"{' and '.join(names)} each constrain the output; send only one",
                param=names[1],
            )
        param, kwargs = asked[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(f"{param}: {exc}", param=param) from None

    def check_unsupported(self) -> None:
        check_extras(self.extras(), self._neutral)
        if self.stream_options is not None:
            check_extras(self.stream_options.extras(), {})
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
        if any(not w.strip() or len(w) > MAX_STOP_CHARS for w in self.bad_words or ()):
            raise APIError(
                f"bad_words entries must hold text and be at most {MAX_STOP_CHARS} characters",
                param="bad_words",
            )
        if self.stream and self.prompt_logprobs:
            raise APIError(
                "prompt_logprobs are not available with stream=true (as vLLM); ask without "
                "streaming",
                param="prompt_logprobs",
            )

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        """`logit_bias` keyed by token id, each bias clamped into ±LOGIT_BIAS_RANGE (as vLLM);
        APIError (400) naming `logit_bias` for a key that is no token id of this vocabulary.
        Also checks `allowed_token_ids` against the vocabulary."""
        bad = [t for t in self.allowed_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                param="allowed_token_ids",
            )
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab_size:
                raise APIError(
                    f"logit_bias key {key!r} is not a token id of this model's vocabulary [0, "
                    f'{vocab_size}); send token ids as strings, e.g. {{"50256": -100}}',
                    param="logit_bias",
                )
            out[token] = min(LOGIT_BIAS_RANGE, max(-LOGIT_BIAS_RANGE, bias))
        return out

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        index: int = 0,
        prompt_logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
    ) -> SamplingParams:
        """Parameters of choice `index` of a prompt (a seeded request's choice i draws with
        seed + i, as vLLM's parallel sampling); `logit_bias` as `token_bias` returns it. Raises
        APIError (400) for values `SamplingParams` rejects."""
        kwargs: dict[str, Any] = {
            "logit_bias": logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
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
            "structured_outputs": self.structured_outputs_params(),
        }
        names = ("temperature", "top_p", "top_k", "min_p")
        for name in (*names, "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return opts is not None and bool(opts.include_usage and opts.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM extension

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_NEUTRAL

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

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """vLLM: prompt_logprobs, else echo asks for the prompt's logprobs at `logprobs`."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call it answers

    def text(self, param: str) -> str:
        """The content as text: parts joined with a newline (vLLM's separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"content part type {part.type!r} is not supported by this server (text "
                    "only); send {'type': 'text', 'text': ...} parts",
                    param=f"{param}.content.{i}",
                )
            texts.append(part.text)
        return "\n".join(texts)


MAX_TOOLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ToolParam(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the chat template writes
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (server/tools.py): the tools reach the chat template; tool_choice decides
    # whether calls are parsed from the output (auto) or not (none); None: auto when tools
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the first)

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_NEUTRAL

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true (as "
                "vLLM); send add_generation_prompt=false",
                param="continue_final_message",
            )

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
    """Messages as the chat template reads them, as vLLM hands them to `transformers`'
    `apply_chat_template`: role and text content; an assistant's `tool_calls` (their JSON
    `arguments` parsed to objects), a tool's `tool_call_id`, and `name` where given."""
    out = []
    for i, m in enumerate(messages):
        check_extras(m.extras(), {})  # e.g. a reasoning model's `reasoning_content`: logged
        d: dict[str, Any] = {"role": m.role, "content": m.text(f"messages.{i}")}
        if m.role == "assistant" and m.tool_calls is not None:
            d["tool_calls"] = [
                _parsed_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _parsed_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    """A tool call with its function's JSON-string `arguments` as an object (templates index
    them); empty arguments become {}."""
    fn = call.get("function")
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if args is None or args == "":
        return call | {"function": fn | {"arguments": {}}}
    if isinstance(args, str):
        try:
            return call | {"function": fn | {"arguments": json.loads(args)}}
        except json.JSONDecodeError:
            raise APIError(
                f"{param}.function.arguments is not valid JSON; send the arguments the model "
                "produced, a JSON object as a string",
                param=f"{param}.function.arguments",
            ) from None
    return call


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: as /v1/completions and /v1/chat/completions would tokenize the prompt
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)  # for the template


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def check_extras(extras: dict[str, Any], neutral: dict[str, tuple[Any, ...]]) -> None:
    """APIError (400) naming the first field of `extras` that would change the answer; every
    other unknown field is logged once per name and ignored (`server/fields.py`)."""
    bad = unsupported_field(extras, neutral)
    if bad is not None:
        name, allowed = bad
        raise APIError(
            f"{name} is not supported by this server; omit it or send {allowed}",
            param=name,
            code="unsupported_parameter",
        )
