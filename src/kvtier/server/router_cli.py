"""`kvtier router`: parse the flags into a `RouterConfig` and serve `server/router.py`'s app."""

from __future__ import annotations

import argparse
import logging

from kvtier.cli_args import configure_logging, parse_bytes
from kvtier.config import RouterConfig, flag_help

log = logging.getLogger("kvtier.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig(replicas=("http://127.0.0.1:8001",))  # the defaults, shown in --help
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help=flag_help(RouterConfig, "replicas"),
    )
    p.add_argument("--host", default=d.host, help=flag_help(RouterConfig, "host"))
    p.add_argument("--port", type=int, default=d.port, help=flag_help(RouterConfig, "port"))
    p.add_argument(
        "--health-interval-s",
        type=float,
        default=d.health_interval_s,
        help=flag_help(RouterConfig, "health_interval_s"),
    )
    p.add_argument(
        "--route-prefix-chars",
        type=int,
        default=d.route_prefix_chars,
        help=flag_help(RouterConfig, "route_prefix_chars"),
    )
    p.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help=flag_help(RouterConfig, "load_factor"),
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=d.max_request_body_bytes,
        help=flag_help(RouterConfig, "max_request_body_bytes"),
    )
    p.add_argument("--log-level", default=d.log_level, help=flag_help(RouterConfig, "log_level"))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of parsed flags (replica URLs without trailing slashes)."""
    return RouterConfig(
        replicas=tuple(u.rstrip("/") for u in args.replica),
        host=args.host,
        port=args.port,
        health_interval_s=args.health_interval_s,
        route_prefix_chars=args.route_prefix_chars,
        load_factor=args.load_factor,
        max_request_body_bytes=args.max_request_body_bytes,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.server.router import build_router_app

    cfg = config_from_args(args)
    configure_logging(cfg.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request otherwise
    log.info("routing http://%s:%d to %s", cfg.host, cfg.port, ", ".join(cfg.replicas))
    server = uvicorn.Server(
        uvicorn.Config(build_router_app(cfg), host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    )
    server.run()
    return 0 if server.started else 1
