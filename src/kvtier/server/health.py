"""The operators' routes: `/health` (the `EngineClient`'s liveness, 503 with its reason) and
`/metrics` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvtier.server.errors import APIError
from kvtier.server.events import EngineClient


def health_routes(engine: EngineClient) -> APIRouter:
    """`/health` and `/metrics` over a started `engine`."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        reason = engine.unhealthy()  # failed, exited, hung or stopped (a heartbeat's age)
        if reason is not None:
            raise APIError(reason, 503, kind="server_error")
        return Response(status_code=200)

    @router.get("/metrics")
    def metrics() -> Response:  # a plain def: an engine in another process answers over a pipe
        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return router
