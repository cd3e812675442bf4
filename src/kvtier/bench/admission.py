"""Admission benchmark: seed 002's near-max-length cost, reproduced on the sim device and compared
with kvtier's shared reserve (modelled device time: deterministic).

vLLM's settled-basis fix charges every sliding-window request `W − 1 + max_in_flight_tokens` tokens
of window blocks (`--admission per-request`); before it, `W − 1 + max_num_batched_tokens`
(`optimistic`: one step's tokens, what pruning on the optimistic count holds); kvtier charges the
steady window per request and the in-flight tokens once for the whole pool (`shared`).

Model: a tiny Gemma-3-like hybrid with random weights, 1 global : 5 sliding layers, the window
1/16 of --max-model-len and steps of half of it (the seed's Gemma at 16K tokens, W 1024, 8192-token
steps, scaled down with its ratios). Async depth 2, no host tier, a device pool that holds what
`optimistic` charges --pool-requests max-length requests (KV-bound: fewer than --concurrency fit).
Two workloads of random prompts scaled from the seed: requests near max length and at a quarter of
it (prompt + --output-len greedy tokens), kept --concurrency in flight by a closed loop.

Per policy: output and total tokens/s and duration on the modelled device clock, TTFT mean and
p99, mean (time-weighted) and peak running requests, preemptions, the max concurrency at max length
that the startup log, `kvtier plan` and /metrics report, and correctness: completions against the
same prompts run synchronously on the CPU backend (float32, greedy), and sanitizer hazards. Prefix
caching is off (random prompts share nothing; freed blocks are handed out most recent first) and
blocks are NaN-poisoned when handed out (the adversarial allocator), so a block reused under a
step in flight corrupts it: `optimistic` also runs with the protections off (`protect=none`) to
show the race that the settled basis and the quarantine close.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench import save_json
from kvtier.bench.admission_report import compare, plot, print_rows
from kvtier.bench.offload_report import percentiles
from kvtier.bench.offload_workload import Workload, drive, ids, sim_device

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore

PROTECTED = "event,settled,quarantine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--window", type=int, default=None, help="sliding window (default max-model-len / 16)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (default max-model-len / 2, as the seed's 8192 of 16K)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--async-depth", type=int, default=2)
    parser.add_argument(
        "--lengths",
        default="0.97,0.25",
        help="request lengths (prompt + output) as fractions of --max-model-len, comma-separated",
    )
    parser.add_argument(
        "--num-requests", default="96,192", help="requests per length, comma-separated"
    )
    parser.add_argument("--output-len", type=int, default=128, help="greedy tokens per request")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="clients in flight (and --max-num-seqs)"
    )
    parser.add_argument(
        "--pool-requests",
        type=int,
        default=12,
        help="device pool: what `optimistic` (vLLM before its fix) charges this many max-length "
        "requests",
    )
    parser.add_argument(
        "--device-blocks", type=int, default=None, help="device pool in blocks (overrides)"
    )
    parser.add_argument("--policies", default="shared,per-request,optimistic")
    parser.add_argument(
        "--unprotected",
        default="optimistic",
        help="policies also run with protect=none (comma-separated; empty for none)",
    )
    parser.add_argument(
        "--no-poison", action="store_true", help="do not NaN-poison blocks when handed out"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="keep freed blocks as prefix-cache entries (default off: random prompts share "
        "nothing, and freed blocks are handed out most recent first, architecture.md §H4)",
    )
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument(
        "--model", default=None, help="HF folder (default: a tiny Gemma-3-like model, built)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_admission.json")
    parser.add_argument("--plot", default=None, help="write a PNG chart here")


def _list(text: str, kind: type, flag: str) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated {kind.__name__} values") from None


def check_args(args: argparse.Namespace) -> None:
    """Fill the defaults that follow --max-model-len; ValueError naming a bad flag."""
    from kvtier.config import ADMISSION_POLICIES

    args.window = args.window or args.max_model_len // 16
    args.max_num_batched_tokens = args.max_num_batched_tokens or args.max_model_len // 2
    args.length_fractions = _list(args.lengths, float, "--lengths")
    args.request_counts = _list(args.num_requests, int, "--num-requests")
    if len(args.request_counts) != len(args.length_fractions):
        raise ValueError("--num-requests needs one count per --lengths entry")
    names = _list(args.policies, str, "--policies") + _list(args.unprotected, str, "--unprotected")
    for name in names:
        if name not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission policy {name!r} unknown; choose from {', '.join(ADMISSION_POLICIES)}"
            )
    for frac in args.length_fractions:
        if not 0 < frac <= 1 or round(frac * args.max_model_len) <= args.output_len:
            raise ValueError(
                f"--lengths {frac}: a request of {round(frac * args.max_model_len)} tokens "
                f"leaves no prompt beside --output-len {args.output_len}"
            )


def build_model(args: argparse.Namespace, folder: Path) -> Path:
    """A tiny Gemma-3-like folder: 6 layers, layer 6 global, 1–5 sliding (random weights)."""
    from kvtier.model.testing import write_tiny_model

    return write_tiny_model(
        folder,
        "gemma3",
        seed=args.seed,
        num_layers=6,
        hidden_size=args.hidden_size,
        num_heads=2,
        num_kv_heads=1,
        window=args.window,
        sliding_window_pattern=6,
        max_position_embeddings=args.max_model_len,
    )


def workload(args: argparse.Namespace, model: Path, fraction: float, num: int) -> Workload:
    """`num` random prompts making requests of `fraction` × max_model_len with the output."""
    from kvtier.bench import serve_data

    total = round(fraction * args.max_model_len)
    spec = serve_data.Dataset(
        "random", num, total - args.output_len, args.output_len, seed=args.seed
    )
    convs = serve_data.build(spec, serve_data.Tok(model), use_ids=True)
    return Workload(convs, num_prefixes=1, prefix_len=0, rounds=1, max_len=total)


def engine_kwargs(args: argparse.Namespace, device_blocks: int) -> dict[str, Any]:
    return {
        "device": "sim",
        "sanitize": "collect",
        "poison": not args.no_poison,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.concurrency,
        "async_depth": args.async_depth,
        "num_device_blocks": device_blocks,
        "enable_prefix_caching": args.enable_prefix_caching,
        "seed": args.seed,
    }


def pool_blocks(args: argparse.Namespace, model: Path) -> int:
    """--device-blocks, or what `optimistic` charges --pool-requests max-length requests."""
    if args.device_blocks is not None:
        return int(args.device_blocks)
    from kvtier.config import CacheConfig, SchedulerConfig
    from kvtier.kv.plan import plan_kv
    from kvtier.model.hf_config import load_model_config

    sched = SchedulerConfig(
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_depth=args.async_depth,
    )
    cache = CacheConfig(args.block_size, num_device_blocks=1 << 24, admission="optimistic")
    plan = plan_kv(load_model_config(model), cache, sched)
    return plan.blocks_for_requests(args.pool_requests, args.max_model_len) + 1


def reference(args: argparse.Namespace, model: Path, w: Workload) -> dict[int, list[int]]:
    """Each conversation's completion run synchronously on the CPU backend, all at once."""
    from kvtier.engine import LLM, SamplingParams

    n = len(w.convs)
    llm = LLM(
        str(model),
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=n,
        async_scheduling=False,
        seed=args.seed,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids(c.prefix) + ids(c.questions[0])} for c in w.convs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {c.index: o.outputs[0].token_ids for c, o in zip(w.convs, outs, strict=True)}


def sample_running(engine: EngineCore, samples: list[tuple[int, int]]) -> Callable[[], None]:
    """A `drive` hook appending (device time, requests running) after every engine step."""

    def sample() -> None:
        stats = engine.stats()
        assert stats.device_time_ns is not None, "bench admission runs on the sim device"
        samples.append((stats.device_time_ns, stats.num_running))

    return sample


def run_row(
    args: argparse.Namespace,
    model: Path,
    w: Workload,
    ref: dict[int, list[int]],
    kw: dict[str, Any],
) -> dict[str, Any]:
    from kvtier.engine import LLM

    engine = LLM(str(model), **kw).engine
    device = sim_device(engine)
    samples: list[tuple[int, int]] = []
    t0_ns, t0_wall = device.now_ns, time.perf_counter()
    records = drive(engine, w, args.concurrency, sample_running(engine, samples))
    wall = time.perf_counter() - t0_wall
    end_ns = max(r.done_ns or 0 for r in records)
    duration = (end_ns - t0_ns) / 1e9
    weighted, last = 0, t0_ns
    for now, running in samples:
        now = min(now, end_ns)
        weighted += running * max(0, now - last)
        last = max(last, now)
    out_tokens = sum(len(r.output or []) for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records)
    stats = engine.stats()
    return {
        "admission": kw["admission"],
        "protect": kw["protect"],
        "requests": len(records),
        "max_concurrency_at_max_len": engine.plan.max_concurrency(),
        # admission charges a request's prompt: the formula at the workload's prompt length
        "max_concurrency_at_prompt_len": engine.plan.max_concurrency(
            num_tokens=w.max_len - args.output_len
        ),
        "peak_running": max(r for _, r in samples),
        "mean_running": weighted / (end_ns - t0_ns),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + prompt_tokens) / duration,
        "ttft_ms": percentiles([r.ttft_device_ms for r in records]),
        "preemptions": stats.num_preemptions,
        "garbled": sum(r.output != ref[r.conv] for r in records),
        "hazards": stats.num_hazards,
        "hazard_kinds": stats.hazards,
        "wall_s": wall,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    check_args(args)
    torch.set_num_threads(args.torch_threads)
    policies = _list(args.policies, str, "--policies")
    variants = [(p, PROTECTED) for p in policies]
    variants += [(p, "none") for p in _list(args.unprotected, str, "--unprotected")]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(args, Path(tmp) / "gemma3-like")
        blocks = pool_blocks(args, model)
        print(
            f"bench admission: {model.name}, max_model_len {args.max_model_len}, window "
            f"{args.window}, {args.max_num_batched_tokens} tokens per step, async depth "
            f"{args.async_depth}, block {args.block_size}; device pool {blocks} blocks (what "
            f"`optimistic` charges {args.pool_requests} max-length requests), no host tier; "
            f"concurrency {args.concurrency}, {args.output_len} output tokens, {args.dtype}, "
            f"prefix caching {'on' if args.enable_prefix_caching else 'off'}"
            + ("" if args.no_poison else ", blocks NaN-poisoned when handed out"),
            flush=True,
        )
        results = []
        for fraction, num in zip(args.length_fractions, args.request_counts, strict=True):
            w = workload(args, model, fraction, num)
            ref = reference(args, model, w)
            rows = []
            for policy, protect in variants:
                kw = {**engine_kwargs(args, blocks), "admission": policy, "protect": protect}
                rows.append(run_row(args, model, w, ref, kw))
            label = f"{fraction:.0%} of max_model_len ({w.max_len} tokens)"
            print_rows(label, rows)
            results.append(
                {
                    "fraction": fraction,
                    "request_tokens": w.max_len,
                    "prompt_tokens": w.max_len - args.output_len,
                    "rows": rows,
                    "vs_optimistic": compare(rows),
                }
            )
    config = {k: v for k, v in vars(args).items() if k != "func"}
    result = {"config": config, "device_blocks": blocks, "workloads": results}
    print(f"saved {save_json(result, args.out)}")
    if args.plot:
        plot(results, args.plot)
    return 0
