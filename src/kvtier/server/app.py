"""The FastAPI app of the OpenAI-compatible server: the body-size cap, errors as OpenAI-shaped
bodies (refusals counted), and the route groups over one `EngineClient` (the engine on a thread, or
in a process of its own); no handler touches the engine."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from kvtier.server.body_limit import BodyLimit
from kvtier.server.completions import completion_routes, render_routes
from kvtier.server.errors import APIError, JSONBody, validation_error
from kvtier.server.events import EngineClient
from kvtier.server.generation import ClientDisconnected
from kvtier.server.health import health_routes
from kvtier.server.info import info_routes
from kvtier.server.tools import ToolConfig

log = logging.getLogger("kvtier.server")


def build_app(
    engine: EngineClient,
    served_model_name: str,
    max_request_body_bytes: int = 4 << 20,
    tool_config: ToolConfig | None = None,
) -> FastAPI:
    """The HTTP app over a started `EngineClient`; `served_model_name` is the only model id, bodies
    over `max_request_body_bytes` get a 413; `tool_config`: `--enable-auto-tool-choice` and
    `--tool-call-parser`."""
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None, default_response_class=JSONBody)
    app.state.engine = engine
    # every refusal is counted once per HTTP request (never per choice), the 413s too
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes, on_refuse=engine.rejected)

    def refused(request: Request, status: int) -> None:
        """Count a refused API request (a health probe's 503 is no refusal)."""
        if request.url.path.startswith(("/v1/", "/tokenize", "/detokenize")):
            engine.rejected(status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        if not exc.admitted:
            refused(request, exc.status)
        return exc.response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # a bug of ours, logged with its traceback; the client still gets an OpenAI-shaped body
        log.error("unhandled error in a request handler", exc_info=exc)
        refused(request, 500)
        return APIError(f"internal error: {exc}", 500, kind="server_error").response()

    @app.exception_handler(ClientDisconnected)
    async def gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        refused(request, 400)
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        refused(request, exc.status_code)
        headers = dict(exc.headers) if exc.headers else None
        return APIError(str(exc.detail), exc.status_code, headers=headers).response()

    app.include_router(health_routes(engine))
    app.include_router(info_routes(engine, served_model_name))
    app.include_router(completion_routes(engine, served_model_name, tool_config))
    app.include_router(render_routes(engine, served_model_name))
    return app
