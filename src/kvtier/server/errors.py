"""What the server answers when a request cannot be served, and the strict JSON every answer is
rendered with: `APIError` and its OpenAI-shaped body, pydantic's validation errors as one 400
naming the field, text UTF-8 cannot carry refused by name. Knows no body model and no engine, so
the engine's side of the server raises `APIError` without loading the bodies (a rule
`tests/test_layers.py` keeps)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


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
        self.admitted = False  # raised after the engine admitted the request (not a refusal)
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
