"""Command line: `kvtier generate · serve · plan · bench …`. Subcommands only parse flags and call into the packages."""

from __future__ import annotations

import argparse
import importlib
import sys

import kvtier
from kvtier.bench import BENCHMARKS
from kvtier.bench.lab import LAB_BENCHMARKS, run_lab
from kvtier.bench.procs import exit_on_signals
from kvtier.cli_args import HelpFormatter


def _add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=help_text, formatter_class=HelpFormatter
    )
    return parser


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvtier.engine import plan_cli

    p = _add_parser(sub, "plan", "compute the KV byte plan of a model configuration")
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    generate_cli = importlib.import_module("kvtier.engine.cli")

    p = _add_parser(sub, "generate", "generate text, streamed to the terminal")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve_cli = importlib.import_module("kvtier.server.cli")  # torch and fastapi load on run

    p = _add_parser(sub, "serve", "serve the OpenAI-compatible HTTP API with /metrics")
    serve_cli.add_arguments(p)
    p.set_defaults(func=serve_cli.run)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _add_parser(sub, "bench", "run a benchmark (prints a summary, saves JSON)")
    p.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    p.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="its flags (NAME --help lists them)"
    )
    p.set_defaults(func=_run_bench)


# Optional dependencies a benchmark flag needs (flag dest → module, pyproject extra), checked
# before the benchmark runs: a missing plotting library would otherwise end a long run.
FLAG_EXTRAS = {"plot": ("matplotlib", "plot")}


def require_extras(ns: argparse.Namespace, command: str) -> None:
    """ValueError naming the pip command for a given flag whose optional dependency is missing."""
    for dest, (module, extra) in FLAG_EXTRAS.items():
        if getattr(ns, dest, None) is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(
                f"{command} {flag} needs {module}, which is not installed: "
                f"pip install 'kvtier[{extra}]'"
            ) from None


def _run_bench(args: argparse.Namespace) -> int:
    if args.name in LAB_BENCHMARKS:  # in the checkout's benchmarks/, not in the package
        run_lab(args.name, args.bench_args)
    # Imported lazily: a benchmark may pull in torch, which `kvtier plan` must not pay for.
    mod = importlib.import_module(f"kvtier.bench.{args.name}")
    command = f"kvtier bench {args.name}"
    parser = argparse.ArgumentParser(
        prog=command, description=mod.__doc__, formatter_class=HelpFormatter
    )
    mod.add_arguments(parser)
    ns = parser.parse_args(args.bench_args)
    require_extras(ns, command)
    # A benchmark stops the servers it started in `finally` blocks; a timeout or kill runs them too
    exit_on_signals()
    return int(mod.run(ns) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvtier {kvtier.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
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
