"""Command line: `kvtier plan · bench …`. Subcommands only parse flags and call into the packages."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.bench import BENCHMARKS


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvtier.kv import plan_cli

    p = sub.add_parser("plan", help="compute the KV byte plan of a model configuration")
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a summary, saves JSON)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHMARKS:
        mod = importlib.import_module(f"kvtier.bench.{name}")
        bp = bsub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0])
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
