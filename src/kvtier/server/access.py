"""Who may call `kvtier serve` and how it is reached, as vLLM's flags spell it: API keys, CORS, and
the TLS and root-path options handed to uvicorn. Owns no route; wraps the app from outside."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier.server.config import ServerConfig

# The environment a key may come from when --api-key is not given: kvtier's own name first, then
# vLLM's, so a deployment written for `vllm serve` keeps its key.
API_KEY_ENVS = ("KVTIER_API_KEY", "VLLM_API_KEY")
# Probes that load balancers and Prometheus read without a key. vLLM guards only /v1/…; here every
# other route (/tokenize, /detokenize, /openapi.json, any added later) needs the key too.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def api_keys(cfg: ServerConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys clients must send: --api-key, else the first API_KEY_ENVS set; () leaves it open."""
    if cfg.api_key:
        return cfg.api_key
    for name in API_KEY_ENVS:
        if environ.get(name, "").strip():
            return (environ[name].strip(),)
    return ()


class ApiKeyGuard:
    """ASGI middleware: a request to any route but OPEN_PATHS without `Authorization: Bearer KEY`
    of one of the keys gets 401 with an OpenAI-shaped error (CORS preflights pass). Keys are kept
    as digests and compared in constant time."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        assert keys, "install the guard only when a key is set"
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = {
            "error": {
                "message": "missing or wrong API key: send `Authorization: Bearer <key>`",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        raw = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        headers.append((b"content-length", str(len(raw)).encode()))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": raw})

    def _allowed(self, scope: Scope) -> bool:
        if route_path(scope) in OPEN_PATHS:
            return True
        value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        return any([hmac.compare_digest(digest, d) for d in self._digests])  # all compared


def route_path(scope: Scope) -> str:
    """The path the router matches: uvicorn prefixes the root path (--root-path), the router
    strips it again, and so does the key check, so both see the same route."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def wrap(app: ASGIApp, cfg: ServerConfig, keys: tuple[str, ...]) -> ASGIApp:
    """The app behind the key guard (when `keys`), both behind CORS: a refusal still carries the
    CORS headers, so a page in the browser can read why."""
    if keys:
        app = ApiKeyGuard(app, keys)
    return CORSMiddleware(
        app,
        allow_origins=cfg.allowed_origins,
        allow_methods=cfg.allowed_methods,
        allow_headers=cfg.allowed_headers,
        allow_credentials=cfg.allow_credentials,
    )


def uvicorn_options(cfg: ServerConfig) -> dict[str, Any]:
    """TLS files and the root path as uvicorn.Config's keywords; a missing file is a ValueError
    naming its flag (before the engine starts)."""
    files = {
        "ssl_keyfile": cfg.ssl_keyfile,
        "ssl_certfile": cfg.ssl_certfile,
        "ssl_ca_certs": cfg.ssl_ca_certs,
    }
    for name, path in files.items():
        if path is not None and not Path(path).is_file():
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {path!r}: no such file; pass a PEM file")
    options: dict[str, Any] = {k: v for k, v in files.items() if v is not None}
    if cfg.ssl_certfile is not None:
        options["ssl_cert_reqs"] = cfg.ssl_cert_reqs
    if cfg.root_path is not None:
        options["root_path"] = cfg.root_path
    return options
