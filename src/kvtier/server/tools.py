"""Tool calling on `/v1/chat/completions`: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` ask of the server (`ToolPlan`), checked against the server's flags
(`--enable-auto-tool-choice`, `--tool-call-parser`, as vLLM's), and the calls of a finished
output shaped as OpenAI's message. `tool_choice` "auto" parses the model's text with its family's
parser (`tool_parsers.py`); "none" shows the tools to the template and parses nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from kvtier.server.tool_parsers import PARSERS, ToolCallStream, ToolParser, parse_tool_calls


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


def plan_tools(body: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The request's `ToolPlan`; APIError (400) naming `tool_choice` for a choice the request or
    the server cannot honour."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
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
    raise APIError(
        f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} needs "
        "structured outputs (the call's JSON schema enforced while sampling), which this "
        'server does not have yet; send tool_choice "auto" or "none"',
        param="tool_choice",
        code="unsupported_parameter",
    )
