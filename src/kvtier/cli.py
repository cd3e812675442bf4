"""Command line: `kvtier generate · serve · router · plan · bench …`. Subcommands only parse flags and call into the packages."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.bench import BENCHMARKS
from kvtier.bench.lab import LAB_BENCHMARKS, run_lab


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvtier.kv import plan_cli

    p = sub.add_parser("plan", help="compute the KV byte plan of a model configuration")
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import importlib

    generate_cli = importlib.import_module("kvtier.engine.cli")

    p = sub.add_parser("generate", help="generate text, streamed to the terminal")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve_cli = importlib.import_module("kvtier.server.cli")  # torch and fastapi load on run

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API with /metrics")
    serve_cli.add_arguments(p)
    p.set_defaults(func=serve_cli.run)


def _add_router(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router_cli = importlib.import_module("kvtier.server.router_cli")

    p = sub.add_parser(
        "router", help="route OpenAI requests to kvtier serve replicas by conversation prefix"
    )
    router_cli.add_arguments(p)
    p.set_defaults(func=router_cli.run)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a summary, saves JSON)")
    p.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    p.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="its flags (NAME --help lists them)"
    )
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    if args.name in LAB_BENCHMARKS:  # in the checkout's benchmarks/, not in the package
        run_lab(args.name, args.bench_args)
    # Imported lazily: a benchmark may pull in torch, which `kvtier plan` must not pay for.
    mod = importlib.import_module(f"kvtier.bench.{args.name}")
    parser = argparse.ArgumentParser(prog=f"kvtier bench {args.name}", description=mod.__doc__)
    mod.add_arguments(parser)
    return int(mod.run(parser.parse_args(args.bench_args)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_router(sub)
    _add_plan(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except ValueError as exc:  # user errors: one clear line, no traceback
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
