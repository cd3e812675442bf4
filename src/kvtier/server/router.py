"""`kvtier router`: one OpenAI endpoint in front of several `kvtier serve` replicas, sending each
conversation to the replica that already holds its prefix (`server/ring.py`), with health checks
and failover. It proxies bytes: requests and responses (SSE streams included) pass through
unchanged, so every replica feature works behind it. No engine, no torch.

Failover: a replica that refuses the connection, drops it, or answers 5xx or 429 before the first
byte of the response body reached the client is marked down (connection errors) and the request
goes to the next replica on the ring; a client therefore never sees a replica die unless it dies
mid-stream, after tokens were sent (that stream then ends with an SSE error event). Health checks
(`GET /health` every `health_interval_s`) mark replicas up and down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.background import BackgroundTask

from kvtier.config import RouterConfig
from kvtier.server.ring import HashRing, attempt_order, route_key

log = logging.getLogger("kvtier.router")

KEYED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
_OWN = {"date", "server"}  # the router's server sets its own
REPLICA_HEADER = "x-kvtier-replica"


def _error(message: str, status: int) -> JSONResponse:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


@dataclass
class _Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "kvtier:router_requests",
            "requests answered, by replica and status",
            ["replica", "status"],
            registry=r,
        )
        self.failovers = Counter(
            "kvtier:router_failovers",
            "attempts that moved on from a replica, by reason",
            ["replica", "reason"],
            registry=r,
        )
        self.unrouted = Counter(
            "kvtier:router_unrouted", "requests no replica could answer", registry=r
        )
        self.up = Gauge(
            "kvtier:router_replica_up",
            "1 while a replica passes its health checks",
            ["replica"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvtier:router_in_flight",
            "requests being proxied to a replica",
            ["replica"],
            registry=r,
        )


class Router:
    """The replicas, their health and load, and the proxying. Lives on one event loop: every
    field is read and written there only."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.ring = HashRing(cfg.replicas)
        self.healthy: set[str] = set()
        self.in_flight: dict[str, int] = dict.fromkeys(cfg.replicas, 0)
        self.metrics = _Metrics()
        timeout = httpx.Timeout(connect=cfg.connect_timeout_s, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    # -- health --------------------------------------------------------------------------------

    def _set_health(self, replica: str, up: bool) -> None:
        was = replica in self.healthy
        if up and not was:
            self.healthy.add(replica)
            log.info("replica %s is up", replica)
        elif not up and was:
            self.healthy.discard(replica)
            log.warning("replica %s is down", replica)
        self.metrics.up.labels(replica).set(1 if up else 0)

    async def check(self, replica: str) -> bool:
        """One health check; marks the replica up or down and returns whether it is up."""
        try:
            resp = await self.client.get(f"{replica}/health", timeout=self.cfg.health_timeout_s)
            up = resp.status_code == 200
        except httpx.HTTPError:
            up = False
        self._set_health(replica, up)
        return up

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.cfg.replicas))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.check_all()

    # -- proxying ------------------------------------------------------------------------------

    def order(self, path: str, body: bytes) -> list[str]:
        """The replicas to try for a request, best first."""
        if path in KEYED_PATHS:
            try:
                parsed: Any = json.loads(body)
            except ValueError:
                parsed = body[: self.cfg.route_prefix_chars]
            key = route_key(path, parsed, self.cfg.route_prefix_chars)
        else:
            key = b""
        ring_order = self.ring.order(key)
        return attempt_order(ring_order, self.healthy, self.in_flight, self.cfg.load_factor)

    async def proxy(self, request: Request) -> Response:
        """Forward `request` to the best replica that answers; see the module docstring."""
        body = await self._body(request)
        if body is None:
            limit = self.cfg.max_request_body_bytes
            return _error(f"request body larger than {limit} bytes", 413)
        path = request.url.path
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        last: Response | None = None
        for replica in self.order(path, body):
            url = f"{replica}{path}"
            if request.url.query:
                url += f"?{request.url.query}"
            req = self.client.build_request(request.method, url, headers=headers, content=body)
            self._enter(replica)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError as exc:
                self.leave(replica)
                self._failed(replica, type(exc).__name__, down=True)
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                content = await resp.aread()
                await resp.aclose()
                self.leave(replica)
                self._failed(replica, str(resp.status_code), down=False)
                last = Response(content, resp.status_code, self._headers(resp, replica))
                continue
            chunks = resp.aiter_raw()
            try:  # the first body bytes: until they arrive, a dying replica can be failed over
                first = await anext(chunks, b"")
            except httpx.TransportError as exc:
                await resp.aclose()
                self.leave(replica)
                self._failed(replica, type(exc).__name__, down=True)
                continue
            self.metrics.requests.labels(replica, str(resp.status_code)).inc()
            done = _Done(self, replica, resp)
            return StreamingResponse(
                self._relay(done, first, chunks),
                status_code=resp.status_code,
                headers=self._headers(resp, replica),
                background=BackgroundTask(done.close),  # runs after a disconnect too
            )
        self.metrics.unrouted.inc()
        if last is not None:
            return last
        return _error("no replica could serve the request (all unreachable)", 503)

    async def _body(self, request: Request) -> bytes | None:
        """The request body, or None past `max_request_body_bytes` (read no further)."""
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.cfg.max_request_body_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    async def _relay(
        self, done: _Done, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:  # the replica died mid-stream: tell an SSE client
            self._failed(done.replica, type(exc).__name__, down=True)
            if done.resp.headers.get("content-type", "").startswith("text/event-stream"):
                message = f"replica failed mid-stream: {type(exc).__name__}"
                event = {"error": {"message": message, "type": "server_error"}}
                yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await done.close()

    def _headers(self, resp: httpx.Response, replica: str) -> dict[str, str]:
        skip = _HOP_BY_HOP | _OWN
        out = {k: v for k, v in resp.headers.items() if k.lower() not in skip}
        out[REPLICA_HEADER] = replica
        return out

    def _enter(self, replica: str) -> None:
        self.in_flight[replica] += 1
        self.metrics.in_flight.labels(replica).set(self.in_flight[replica])

    def leave(self, replica: str) -> None:
        """One request on `replica` is done (mutates its in-flight count and gauge)."""
        self.in_flight[replica] -= 1
        self.metrics.in_flight.labels(replica).set(self.in_flight[replica])

    def _failed(self, replica: str, reason: str, down: bool) -> None:
        log.warning("replica %s failed (%s); trying the next one", replica, reason)
        self.metrics.failovers.labels(replica, reason).inc()
        if down:
            self._set_health(replica, False)


class _Done:
    """Closes a proxied response and counts its replica's request done, exactly once."""

    def __init__(self, router: Router, replica: str, resp: httpx.Response) -> None:
        self.router, self.replica, self.resp = router, replica, resp
        self.closed = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.resp.aclose()
            self.router.leave(self.replica)


def build_router_app(cfg: RouterConfig) -> FastAPI:
    """The router's ASGI app: its own /health and /metrics, everything else proxied."""
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.check_all()
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await router.client.aclose()

    app = FastAPI(
        title="kvtier router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        if router.healthy:
            return Response(status_code=200)
        return _error("no healthy replica", 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request) -> Response:
        return await router.proxy(request)

    return app
