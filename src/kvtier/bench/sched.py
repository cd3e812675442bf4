"""`kvtier bench sched`: host time of schedule() + update() per step and per request-step.

Drives the real scheduler and KV manager with the fake runner (runner time is not counted); reports
medians for prefill-heavy and decode steps apart, sync and async, per KV-spec family. Prints a table
and saves JSON; asserts nothing about timings. vLLM's scheduler on the same workload, measured in
the same run: `kvtier bench compare --parts sched`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from typing import Any

from kvtier.bench import save_json
from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import FullAttention, KVCacheManager, KVSpec, SlidingWindow
from kvtier.sampling import StopConditions
from kvtier.sched import Request, RunnerOutput, Scheduler
from kvtier.sched.output import SchedulerOutput


def make_specs(kind: str, block_size: int, window: int) -> list[KVSpec]:
    """full · swa · hybrid (full + sliding window) KV-cache groups."""
    if kind == "full":
        return [FullAttention(block_size)]
    if kind == "swa":
        return [SlidingWindow(block_size, window)]
    if kind == "hybrid":
        return [FullAttention(block_size), SlidingWindow(block_size, window)]
    raise ValueError(f"unknown spec family {kind!r}; use full, swa or hybrid")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--window", type=int, default=256, help="sliding window (swa, hybrid)")
    parser.add_argument("--specs", nargs="+", default=["full", "swa", "hybrid"])
    parser.add_argument(
        "--modes", nargs="+", default=["sync", "async"], help="sync = depth 1, async = depth 2"
    )
    parser.add_argument("--hash", default="sha256", help="prefix-cache block hash: sha256|xxhash")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per configuration; the best median is kept"
    )
    parser.add_argument("--out", default="results/bench_sched.json")


def _phase(output: SchedulerOutput) -> str:
    """ "prefill" if the step carries any prompt chunk, else "decode"."""
    if output.scheduled_new_reqs:
        return "prefill"
    spec = output.scheduled_spec_decode_tokens
    for req_id, n in output.num_scheduled_tokens.items():
        if n - len(spec.get(req_id, ())) > 1:
            return "prefill"
    return "decode"


def run_one(args: argparse.Namespace, kind: str, mode: str, num_requests: int) -> dict[str, Any]:
    """One configuration: every request arrives at t=0; returns timing summaries."""
    depth = 1 if mode == "sync" else 2
    budget = args.max_num_batched_tokens
    kv = KVCacheManager(
        make_specs(kind, args.block_size, args.window),
        args.num_blocks,
        max_model_len=args.prompt_len + args.output_len,
        enable_caching=not args.no_prefix_caching,
        max_in_flight_tokens=depth * budget,
        hash_fn=args.hash,
    )
    sched = Scheduler(
        kv, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, async_depth=depth
    )
    runner = FakeRunner()
    for i in range(num_requests):
        base = (i + 1) * 1_000_003
        prompt = [(base + j * 7919) % 50_000 for j in range(args.prompt_len)]  # unique prefixes
        sp = StopConditions(max_tokens=args.output_len, ignore_eos=True)
        sched.add_request(Request(f"req-{i}", prompt, sp))
    # Per step: (phase, scheduled requests, schedule seconds, update seconds)
    steps: dict[int, list[Any]] = {}
    in_flight: deque[tuple[SchedulerOutput, RunnerOutput]] = deque()
    clock = time.perf_counter
    gc.collect()
    start = clock()
    while in_flight or sched.has_unfinished_requests():
        if sched.can_schedule() and sched.has_unfinished_requests():
            t0 = clock()
            out = sched.schedule()
            t1 = clock()
            steps[out.step_seq] = [_phase(out), len(out.num_scheduled_tokens), t1 - t0, 0.0]
            in_flight.append((out, runner.execute(out)))
            if not out.is_empty and sched.can_schedule():
                continue
        out, result = in_flight.popleft()
        t0 = clock()
        sched.update(out, result)
        steps[out.step_seq][3] = clock() - t0
    wall = clock() - start
    return {
        "spec": kind,
        "mode": mode,
        "async_depth": depth,
        "num_requests": num_requests,
        "num_steps": len(steps),
        "num_preemptions": sched.num_preemptions,
        "wall_s": wall,
        "host_s": sum(s[2] + s[3] for s in steps.values()),
        **{phase: _summary([s for s in steps.values() if s[0] == phase]) for phase in _PHASES},
    }


_PHASES = ("prefill", "decode")


def _summary(steps: list[list[Any]]) -> dict[str, Any]:
    live = [s for s in steps if s[1] > 0]
    if not live:
        return {"num_steps": 0}
    per_step = [(s[2] + s[3]) * 1e6 for s in live]
    per_req = [(s[2] + s[3]) * 1e6 / s[1] for s in live]
    return {
        "num_steps": len(live),
        "median_reqs_per_step": statistics.median(s[1] for s in live),
        "median_us_per_step": statistics.median(per_step),
        "median_us_per_request_step": statistics.median(per_req),
        "median_us_schedule_per_request": statistics.median(s[2] * 1e6 / s[1] for s in live),
        "median_us_update_per_request": statistics.median(s[3] * 1e6 / s[1] for s in live),
        "mean_us_per_request_step": sum(per_step) / sum(s[1] for s in live),
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the run with the lowest median µs per request-step (the least disturbed)."""
    best = dict(runs[0])
    for phase in _PHASES:
        key = "median_us_per_request_step"
        timed = [r[phase] for r in runs if key in r[phase]]
        if timed:
            best[phase] = min(timed, key=lambda p: p[key])
    best["num_runs"] = len(runs)
    return best


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be ≥ 1, got {args.repeat}")
    for kind in args.specs:
        make_specs(kind, args.block_size, args.window)  # fail fast on a bad family name
    results = []
    header = f"{'spec':7} {'mode':5} {'reqs':>5} {'steps':>6}  "
    header += "prefill µs/step µs/req-step | decode µs/step µs/req-step"
    print(header)
    for kind in args.specs:
        for mode in args.modes:
            for n in args.num_requests:
                runs = [run_one(args, kind, mode, n) for _ in range(args.repeat)]
                r = _best(runs)
                results.append(r)
                pre, dec = r["prefill"], r["decode"]
                print(
                    f"{kind:7} {mode:5} {n:5d} {r['num_steps']:6d}  "
                    f"{pre.get('median_us_per_step', 0):13.0f} "
                    f"{pre.get('median_us_per_request_step', 0):11.1f} | "
                    f"{dec.get('median_us_per_step', 0):12.0f} "
                    f"{dec.get('median_us_per_request_step', 0):11.1f}"
                )
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    path = save_json({"config": config, "results": results}, args.out)
    print(f"saved {path}")
    return 0
