"""`kvtier bench preempt`: preemptions per async depth, with the quarantine on and off.

Under async scheduling a preempted request's blocks go to the quarantine until the steps in
flight are processed, so they free nothing at once; a scheduler that did not count them preempted
victim after victim (issue 12 item 17). One workload — requests arriving together on a device pool
far smaller than they need at once — runs on the sim device at depth 1 (sync), 2 and 3, with the
quarantine on and off. Prints preemptions and their ratio to depth 1, and whether every
configuration produced the same tokens; saves JSON. Asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from benchmarks import main
from kvtier.bench import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-device-blocks",
        type=int,
        default=None,
        help="device KV blocks (default: a quarter of what every request needs at once)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_preempt.json")


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """`--num-requests` prompts of random tokens, lengths drawn in [min, max] prompt."""
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]


def max_model_len(args: argparse.Namespace) -> int:
    return int(args.max_prompt + args.max_tokens + args.block_size)


def default_num_blocks(args: argparse.Namespace, model: str) -> int:
    """A quarter of the blocks every request needs at once at its full length (at least two
    longest requests' worth), from the engine's own KV plan of the model."""
    from kvtier.config import CacheConfig, SchedulerConfig
    from kvtier.kv.plan import plan_kv
    from kvtier.model.hf_config import load_model_config

    n = max_model_len(args)
    sched = SchedulerConfig(max_model_len=n, max_num_batched_tokens=args.max_num_batched_tokens)
    cache = CacheConfig(block_size=args.block_size, num_device_blocks=1 << 20)
    per_request = plan_kv(load_model_config(model), cache, sched).blocks_per_request(n)
    return max(2 * per_request, per_request * int(args.num_requests) // 4) + 1


def run_one(
    args: argparse.Namespace, prompts: list[list[int]], depth: int, quarantine: bool, blocks: int
) -> dict[str, Any]:
    """One configuration: every request at once; returns counts and the tokens."""
    from kvtier.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        device="sim",
        dtype=args.dtype,
        seed=args.seed,
        block_size=args.block_size,
        num_device_blocks=blocks,
        max_model_len=max_model_len(args),
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=depth > 1,
        async_depth=depth,
        protect="event,settled,quarantine" if quarantine else "event,settled",
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.stats()
    return {
        "async_depth": depth,
        "quarantine": quarantine,
        "num_preemptions": stats.num_preemptions,
        "num_steps": stats.num_steps,
        "wall_s": time.perf_counter() - t0,
        "idle_after": stats.is_idle,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def run(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.max_tokens < 1 or not 1 <= args.min_prompt <= args.max_prompt:
        raise ValueError(
            "--num-requests and --max-tokens must be ≥ 1 and 1 ≤ --min-prompt ≤ --max-prompt"
        )
    bad = [d for d in args.depths if d not in (1, 2, 3)]
    if bad:
        raise ValueError(f"--depths takes 1, 2 or 3, got {bad}")
    from kvtier.engine.params import DEFAULT_MODEL
    from kvtier.model.hf_config import load_model_config

    model = args.model or str(DEFAULT_MODEL)
    args.model = model
    prompts = workload(args, load_model_config(model).vocab_size)
    blocks = args.num_device_blocks or default_num_blocks(args, model)
    print(f"{args.num_requests} requests, {blocks} device blocks of {args.block_size} tokens")
    print(f"{'depth':>5} {'quarantine':>10} {'preemptions':>11} {'× depth 1':>9} {'steps':>6}")
    results = []
    base: dict[bool, int] = {}
    for quarantine in (True, False):
        for depth in args.depths:
            r = run_one(args, prompts, depth, quarantine, blocks)
            results.append(r)
            if depth == 1:
                base[quarantine] = r["num_preemptions"]
            ref = base.get(quarantine)
            ratio = r["num_preemptions"] / ref if ref else None
            r["ratio_to_depth_1"] = ratio
            shown = f"{ratio:9.2f}" if ratio is not None else f"{'-':>9}"
            print(
                f"{depth:5d} {'on' if quarantine else 'off':>10} {r['num_preemptions']:11d} "
                f"{shown} {r['num_steps']:6d}"
            )
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"same tokens in every configuration: {same}")
    for r in results:
        del r["tokens"]
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    config["num_device_blocks"] = blocks
    path = save_json({"config": config, "same_tokens": same, "results": results}, args.out)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
