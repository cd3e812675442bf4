"""ASGI middleware that caps request bodies: a declared Content-Length over the cap, or a body
(chunked or not) that grows past it, is answered with an OpenAI-shaped 413 before the app parses a
byte of it. Bodies under the cap are buffered and replayed to the app unchanged."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.server.errors import APIError


class BodyLimit:
    """Wraps `app`; `max_bytes` is the largest body accepted; `on_refuse(413)` counts each
    refusal."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[int], None] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # uvicorn reads and discards the rest of the body after this answer, so a client
            # that sends everything before reading still gets it
            await self._refuse(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(parts), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(
            f"the request body is larger than {self.max_bytes} bytes (the server's "
            "--max-request-body-bytes); send a smaller request",
            413,
            code="request_too_large",
        )
        if self.on_refuse is not None:
            self.on_refuse(err.status)
        await err.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses such a request before we see it
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out `body` once, then the connection's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
