"""`kvtier serve [MODEL]`: the OpenAI-compatible server over one engine (engine flags as
`generate`, deployment flags as vLLM's), the engine in a process of its own by default. The server
exits 1 when the engine fails (or its process dies), after answering the requests in flight."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import replace
from typing import TYPE_CHECKING

from kvtier.cli_args import add_dataclass_args, configure_logging, dataclass_from_args
from kvtier.engine.cli import add_engine_arguments, engine_args
from kvtier.server.config import ServerConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from kvtier.server.events import EngineClient
    from kvtier.server.kv_events import KVEventsConfig

log = logging.getLogger("kvtier.server")
DEFAULT_MODEL_NAME = "kvtier-default"
# Testing aid (documented in docs/serving.md): the engine thread raises at this step, as a crashing
# forward would, so the dead-engine path can be exercised end to end.
FAIL_AT_STEP_ENV = "KVTIER_DEBUG_FAIL_AT_STEP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="local HF model folder, as in `vllm serve MODEL` (or --model; default: embedded)",
    )
    add_dataclass_args(parser, ServerConfig)
    add_engine_arguments(parser)


def model_of(args: argparse.Namespace) -> str | None:
    """The model of `kvtier serve MODEL` or `--model MODEL` (both: they must agree)."""
    tag, flag = args.model_tag, args.model
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(
            f"MODEL {tag!r} and --model {flag!r} disagree; pass the model once (`kvtier serve "
            "MODEL` as vLLM's `vllm serve MODEL`, or --model)"
        )
    folders = [k for k in args.api_key or () if os.path.isdir(k)]
    if tag is None and flag is None and folders:  # --api-key takes one or more values
        raise ValueError(
            f"--api-key took {folders[0]!r}, a folder: write the model first (`kvtier serve "
            "MODEL --api-key KEY`) or pass --model"
        )
    return tag if tag is not None else flag  # type: ignore[no-any-return]


def make_server(engine: EngineClient, app: FastAPI, config: uvicorn.Config) -> uvicorn.Server:
    """A uvicorn server that shuts down when the engine thread fails (as vLLM's API server does):
    open responses end with their error, new connections are refused, `run()` returns."""
    import uvicorn

    server = uvicorn.Server(config)

    def stop(_: BaseException) -> None:
        server.should_exit = True  # polled by uvicorn's main loop

    engine.on_failure(stop)
    return server


def _shut_down(signum: int, _frame: object) -> None:
    log.info("signal %d: the server has shut down; closing the engine", signum)


def _fail_at_step() -> int | None:
    value = os.environ.get(FAIL_AT_STEP_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FAIL_AT_STEP_ENV} must be a step number ≥ 1, got {value!r}")
    return int(value)


def _kv_events(text: str | None) -> KVEventsConfig | None:
    """The `--kv-events-config` given (None: none); ValueError naming the field."""
    if text is None:
        return None
    try:  # pyzmq and msgspec come with the kv-events extra
        from kvtier.server.kv_events import KVEventsConfig
        from kvtier.server.kv_publisher import KVEventPublisher  # noqa: F401  (zmq is there)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"--kv-events-config needs {exc.name} (not installed): pip install "
            "'kvtier[kv-events]', or drop --kv-events-config"
        ) from exc
    return KVEventsConfig.from_json(text)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.server import access
    from kvtier.server.app import build_app
    from kvtier.server.engine_loop import EngineLoop
    from kvtier.server.engine_process import EngineProcess
    from kvtier.server.tools import ToolConfig
    from kvtier.server.vllm_metrics import MetricNames

    cfg = dataclass_from_args(ServerConfig, args)
    configure_logging(cfg.log_level)
    args.model = model_of(args)
    keys = access.api_keys(cfg, os.environ)
    options = access.uvicorn_options(cfg)  # a missing TLS file fails before the engine starts
    loop: EngineClient
    eargs, fail_at = engine_args(args), _fail_at_step()
    kv_events = _kv_events(cfg.kv_events_config)
    if kv_events is not None:
        eargs = replace(eargs, enable_kv_cache_events=kv_events.publishes)
    timeout_s = cfg.engine_iteration_timeout_s
    name = cfg.served_model_name or args.model or DEFAULT_MODEL_NAME
    names = MetricNames(name, cfg.metrics_prefix)
    if cfg.engine_process:
        loop = EngineProcess(
            eargs,
            cfg.max_waiting_requests,
            fail_at,
            cfg.log_level,
            timeout_s,
            metric_names=names,
            kv_events=kv_events,
        )
    else:
        loop = EngineLoop(
            eargs, cfg.max_waiting_requests, fail_at, iteration_timeout_s=timeout_s,
            metric_names=names, kv_events=kv_events,
        )  # fmt: skip
    loop.start()
    log.info(loop.layout_summary)
    tools = ToolConfig(cfg.enable_auto_tool_choice, cfg.tool_call_parser)
    app = build_app(loop, name, cfg.max_request_body_bytes, tools)
    scheme = "https" if cfg.ssl_certfile else "http"
    guard = f"an API key ({len(keys)}) required" if keys else "no API key"
    log.info("serving %r on %s://%s:%d/v1, %s", name, scheme, cfg.host, cfg.port, guard)
    config = uvicorn.Config(
        access.wrap(app, cfg, keys),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        **options,
    )
    server = make_server(loop, app, config)
    # uvicorn re-raises the SIGTERM/SIGINT it shut down for once `run()` ends; answered here by
    # a no-op, it would otherwise kill the process before the engine closes its tiers (queued
    # disk and remote writes would be lost, the disk folder left for the OS to unlock)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _shut_down)
    try:
        server.run()
    finally:
        loop.stop()
    if loop.error is not None:
        log.error("exiting: the engine failed (%s: %s)", type(loop.error).__name__, loop.error)
        return 1
    return 0 if server.started else 1  # e.g. the port was taken (uvicorn logged why)
