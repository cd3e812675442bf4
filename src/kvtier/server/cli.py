"""`kvtier serve`: the OpenAI-compatible server over one engine (engine flags as `generate`)."""

from __future__ import annotations

import argparse
import logging

from kvtier.cli_args import add_dataclass_args, dataclass_from_args
from kvtier.config import ServerConfig
from kvtier.engine.cli import add_engine_arguments, engine_args

log = logging.getLogger("kvtier.server")
DEFAULT_MODEL_NAME = "kvtier-default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, ServerConfig)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.server.app import build_app
    from kvtier.server.engine_loop import EngineLoop

    cfg = dataclass_from_args(ServerConfig, args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    loop = EngineLoop(engine_args(args), cfg.max_waiting_requests, cfg.torch_threads)
    loop.start()
    log.info(loop.layout_summary)
    name = cfg.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = build_app(loop, name)
    log.info("serving %r on http://%s:%d/v1", name, cfg.host, cfg.port)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    finally:
        loop.stop()
    return 0
