"""Serving benchmark: a client for any OpenAI-compatible server (streaming /v1/completions).

Datasets `random` (prompts of --input-len, --output-len tokens, ±--range-ratio) and
`shared-prefix` (--num-prompts conversations over --num-prefixes shared prefixes of --prefix-len
tokens, --num-rounds rounds each: a round's prompt is the previous prompt + its answer + a new
question of --input-len tokens). Conversations start at Poisson times (--request-rate, inf = all
at once; later rounds follow their previous answer at once), at most --max-concurrency requests in
flight. Prints `vllm bench serve`'s summary plus the prefix-cache hit share (`cached_tokens`),
saves JSON with per-request records, and with --plot a PNG of TTFT / ITL distributions. Only
--base-url is contacted; every request has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model id the server serves")
    add_workload_arguments(parser)
    parser.add_argument("--save-text", action="store_true", help="keep generated text in JSON")
    parser.add_argument("--out", default="results/bench_serve.json")
    parser.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        help="write a PNG of TTFT / ITL distributions (default path: --out with .png)",
    )


def add_workload_arguments(parser: argparse.ArgumentParser, dataset: str = "random") -> None:
    """The flags of the requests sent (dataset, lengths, rates, sampling), shared with
    `kvtier bench router`."""
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default=dataset)
    parser.add_argument("--num-prompts", type=int, default=100, help="requests (conversations)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt (question) tokens")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary ±ratio")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: prefixes")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens")
    parser.add_argument("--num-rounds", type=int, default=3, help="shared-prefix: rounds")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight (0: unlimited)"
    )
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="fixed output lengths")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None, help="sent when given (0 < p ≤ 1)")
    parser.add_argument("--top-k", type=int, default=None, help="sent when given (≥ 1)")
    parser.add_argument("--min-p", type=float, default=None, help="sent when given (0 ≤ p ≤ 1)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="folder or tokenizer.json for prompts and counting; 'none' for text prompts "
        "counted by the server's usage (default: --model if a local folder)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="token-id or text prompts (auto: ids when a tokenizer is known)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 90,99")


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _models(root: str, timeout: float) -> dict[str, Any] | None:
    """GET /v1/models of the server (for a sanity check), None if it does not answer."""
    try:
        with urllib.request.urlopen(f"{root}/v1/models", timeout=min(timeout, 30)) as resp:
            return dict(json.loads(resp.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def sampling_extra(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields --top-p, --top-k and --min-p add (only those given), checked here so a
    bad value stops the run before the first request, naming the flag."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0.0):
        raise SystemExit(f"--temperature must be ≥ 0 (0 is greedy), got {args.temperature}")
    extra: dict[str, Any] = {}
    if args.top_p is not None:
        if not 0.0 < args.top_p <= 1.0:
            raise SystemExit(f"--top-p must be in (0, 1] (1 keeps every token), got {args.top_p}")
        extra["top_p"] = args.top_p
    if args.top_k is not None:
        if args.top_k < 1:
            raise SystemExit(f"--top-k must be ≥ 1 (leave it out to keep every token), got "
                             f"{args.top_k}")  # fmt: skip
        extra["top_k"] = args.top_k
    if args.min_p is not None:
        if not 0.0 <= args.min_p <= 1.0:
            raise SystemExit(f"--min-p must be in [0, 1], got {args.min_p}")
        extra["min_p"] = args.min_p
    return extra


def check_workload(args: argparse.Namespace) -> None:
    """SystemExit naming the flag for a workload that cannot run."""
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be at least 1")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit("--range-ratio must be in [0, 1)")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 0:
        raise SystemExit("--max-concurrency must be 0 (unlimited) or more")


def run(args: argparse.Namespace) -> int:
    try:
        from kvtier.bench import serve_client, serve_data, serve_report
    except ImportError as exc:  # httpx is a dev extra
        raise SystemExit(f"kvtier bench serve needs {exc.name}: pip install -e '.[dev]'") from None

    check_workload(args)
    extra = sampling_extra(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    root = _root(args.base_url)
    tok = serve_data.resolve_tokenizer(args.tokenizer, args.model)
    use_ids = args.prompt_format == "ids" or (args.prompt_format == "auto" and tok is not None)
    if use_ids and tok is None:
        raise SystemExit("--prompt-format ids needs a tokenizer (--tokenizer)")
    card = _models(root, args.timeout)
    max_len = None
    if card is None:
        print(f"warning: {root}/v1/models did not answer")
    else:
        ids = [m.get("id") for m in card.get("data", [])]
        if args.model not in ids:
            print(f"warning: the server lists models {ids}, not {args.model!r}")
        max_len = next(
            (m.get("max_model_len") for m in card["data"] if m.get("id") == args.model), None
        )
    convs = serve_data.build(serve_data.Dataset.from_args(args), tok, use_ids)
    rounds = len(convs[0].questions)
    longest = (
        (args.prefix_len if args.dataset == "shared-prefix" else 0)
        + rounds * int(args.input_len * (1 + args.range_ratio))
        + rounds * int(args.output_len * (1 + args.range_ratio))
    )
    if max_len is not None and longest > max_len:
        print(f"warning: requests may need up to {longest} tokens > max_model_len {max_len}")
    settings = serve_client.Settings(
        url="/v1/completions",
        model=args.model,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout=args.timeout,
        extra=extra,
    )
    print(
        f"bench serve: {args.dataset}, {args.num_prompts} conversations × {rounds} rounds, "
        f"{'token-id' if use_ids else 'text'} prompts, tokenizer "
        f"{tok.path if tok else 'none (server usage)'}, concurrency "
        f"{args.max_concurrency or 'unlimited'}, rate {args.request_rate} req/s → {root}",
        flush=True,
    )
    records, duration = asyncio.run(
        serve_client.run_all(convs, settings, tok, args.max_concurrency, root)
    )
    records.sort(key=lambda r: (r.conversation, r.round))
    summary = serve_report.summarize(records, duration, percentiles)
    by_round = serve_report.rounds(records)
    print(serve_report.render(summary, by_round, args.max_concurrency))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = str(args.request_rate)
    config["prompt_format"] = "ids" if use_ids else "text"
    config["tokenizer"] = str(tok.path) if tok else None
    result = {
        "config": config,
        "summary": summary,
        "rounds": by_round,
        "requests": [r.as_dict(args.save_text) for r in records],
    }
    print(f"saved {save_json(result, args.out)}")
    if args.plot is not None:
        png = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
        title = f"kvtier bench serve: {args.model}, {args.dataset}, concurrency {args.max_concurrency or '∞'}"
        print(f"plot {serve_report.plot(records, png, title)}")
    return 0 if summary["completed"] else 1
