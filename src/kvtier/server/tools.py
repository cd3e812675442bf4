"""Tool calling on `/v1/chat/completions`: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` ask of the server (`ToolPlan`), checked against the server's flags
(`--enable-auto-tool-choice`, `--tool-call-parser`, as vLLM's), and the calls of a finished
output shaped as OpenAI's message. `tool_choice` "auto" parses the model's text with its family's
parser (`tool_parsers.py`); "none" shows the tools to the template and parses nothing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvtier.engine.params import SamplingParams
from kvtier.sampling import StructuredOutputsParams
from kvtier.server.errors import APIError
from kvtier.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvtier.server.tool_parsers import (
    PARSERS,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallStream,
    ToolParser,
    parse_tool_calls,
)


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """The server's tool flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with tools: the entries its template sees, the parser of its
    output (None: the text is the answer) and how many calls it may return."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    max_calls: int | None = None
    schema: dict[str, Any] | None = None  # what the output is held to (required, named)

    def stream(self) -> ToolCallStream | None:
        """A fresh per-choice streamer, None when nothing is parsed."""
        return None if self.parser is None else ToolCallStream(self.parser, self.max_calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished choice's assistant message and finish reason ("tool_calls" when it ended
        on its own with calls, as OpenAI)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(self.parser, text, self.max_calls)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        msg = {"role": "assistant", "content": content, "tool_calls": calls}
        return msg, "tool_calls" if finish_reason == "stop" else finish_reason

    def skip_special_tokens(self, skip: bool) -> bool:
        return skip if self.parser is None else self.parser.adjust_skip_special_tokens(skip)


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template reads them (OpenAI's entries); None: none."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def plan_tools(body: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The request's `ToolPlan`; APIError (400) naming `tool_choice` for a choice the request or
    the server cannot honour."""
    tools = template_tools(body) or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise APIError(
                'tool_choice needs tools; send the tools the model may call, or tool_choice "none"',
                param="tool_choice",
            )
        return ToolPlan()
    max_calls = 1 if body.parallel_tool_calls is False else None
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names function {choice.function.name!r}, which is not among the "
                f"tools ({', '.join(names)}); name one of them",
                param="tool_choice",
            )
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise APIError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser (as vLLM); send tool_choice "none" or restart the '
                "server with them",
                param="tool_choice",
            )
        return ToolPlan(tools, PARSERS[config.tool_call_parser](), max_calls)
    if choice == "required":
        schema = calls_schema(tools, max_calls)
        return ToolPlan(tools, RequiredCallsParser(), max_calls, schema)
    assert isinstance(choice, NamedToolChoice)
    (tool,) = [t for t in tools if t["function"]["name"] == choice.function.name][:1]
    return ToolPlan(tools, NamedCallParser(choice.function.name), 1, _parameters(tool))


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = tool["function"].get("parameters") or {"type": "object"}
    return params


def calls_schema(tools: list[dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    """The JSON schema tool_choice "required" holds the output to (vLLM's shape): an array of at
    least one (at most `max_calls`) {"name": one of the tools, "parameters": its arguments}."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def constrain(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """`params` with the plan's schema (tool_choice "required" or a named function) enforced
    while sampling, through structured outputs; APIError (400) naming `tool_choice` when the
    request also constrains its output another way."""
    if plan.schema is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(
            'tool_choice "required" or a named function holds the output to the tools\' JSON '
            "schema, so it cannot be combined with response_format or structured_outputs; send "
            'one of them (or tool_choice "auto")',
            param="tool_choice",
        )
    try:
        so = StructuredOutputsParams(json=plan.schema)
        return replace(params, structured_outputs=so)
    except ValueError as exc:  # min_tokens with a grammar, as for response_format
        raise APIError(str(exc), param="tool_choice") from exc
