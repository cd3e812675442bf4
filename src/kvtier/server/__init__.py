"""OpenAI-compatible HTTP server (FastAPI + uvicorn) with Prometheus metrics: `build_app` over an
`EngineClient` — an `EngineLoop` (the one thread that owns the `EngineCore`) or an `EngineProcess`
(that loop in a process of its own, `kvtier serve`'s default). Start it with `kvtier serve`. Nothing is
imported eagerly, so parsing `kvtier` flags stays free of torch and FastAPI."""

from __future__ import annotations

from typing import Any

__all__ = ["EngineLoop", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from kvtier.server.app import build_app

        return build_app
    if name == "EngineLoop":
        from kvtier.server.engine_loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)
