"""`kvtier serve`: the OpenAI-compatible server over one engine (engine flags as `generate`)."""

from __future__ import annotations

import argparse
import logging

from kvtier.engine.cli import add_engine_arguments, engine_args

log = logging.getLogger("kvtier.server")
DEFAULT_MODEL_NAME = "kvtier-default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help=f"model id clients send (default: --model, or {DEFAULT_MODEL_NAME!r})",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests allowed to wait for admission; more get HTTP 429",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads of the engine thread"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.server.app import build_app
    from kvtier.server.engine_loop import EngineLoop

    if args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be ≥ 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    loop = EngineLoop(engine_args(args), args.max_waiting_requests, args.torch_threads)
    loop.start()
    log.info(loop.layout_summary)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = build_app(loop, name)
    log.info("serving %r on http://%s:%d/v1", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()
    return 0
