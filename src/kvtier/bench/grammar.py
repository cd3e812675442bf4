"""Structured outputs' cost: output tokens/s of requests constrained to a JSON schema beside the
same requests unconstrained, at a fixed concurrency, per model and async depth.

Every request decodes exactly `--output-len` tokens in both modes: free ones ignore EOS, and the
schema (an array of at least `--min-items` small objects) cannot end sooner, so the ratio is the
grammar's cost per token (the mask fill, the logits mask, the sampled tokens read back inside
the forward op). Both modes run on one engine, alternating for `--rounds` rounds on new prompts;
the cost is the median of the paired ratios, with their quartiles (the spread one run holds).
Prints a table and saves JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import models, save_json
from kvtier.bench.throughput import random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="default,qwen2-0.5b-shape", help=models.HELP)
    parser.add_argument("--depths", default="1,2", help="async depths (1 = synchronous)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at once")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--min-items", type=int, default=64, help="the schema's minItems")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"results/bench_grammar_{time.strftime('%Y%m%d')}.json")


def schema(min_items: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "name", "kind"],
    }
    return {"type": "array", "items": item, "minItems": min_items}


def run_pass(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in got)
    return {
        "seconds": elapsed,
        "output_tokens": n,
        "output_tokens_per_s": n / elapsed,
        "cores": (time.process_time() - c0) / elapsed,
        "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in got}),
    }


def run_one(path: str, vocab: int, depth: int, args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(
        path,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.concurrency,
        max_model_len=args.input_len + args.output_len + 16,
        async_scheduling=depth > 1,
        async_depth=depth,
        seed=args.seed,
        torch_threads=args.torch_threads,
    )
    n = args.output_len
    so = StructuredOutputsParams(json=json.dumps(schema(args.min_items)))
    params = {
        "free": SamplingParams(max_tokens=n, temperature=1.0, seed=args.seed, ignore_eos=True),
        "json_schema": SamplingParams(
            max_tokens=n, temperature=1.0, seed=args.seed, structured_outputs=so
        ),
    }
    warm = random_prompts(args.seed + 999, 2, args.input_len, vocab)
    for p in params.values():  # first-call costs, and the grammar compiled once
        llm.generate([{"prompt_token_ids": q} for q in warm], p, use_tqdm=False)
    rounds = []
    for r in range(args.rounds):  # new prompts for every pass: no prefix hit favours either
        rounds.append(
            {
                mode: run_pass(
                    llm,
                    random_prompts(args.seed + 2 * r + i, args.concurrency, args.input_len, vocab),
                    p,
                )
                for i, (mode, p) in enumerate(params.items())
            }
        )
    ratios = [
        x["json_schema"]["output_tokens_per_s"] / x["free"]["output_tokens_per_s"] for x in rounds
    ]
    llm.engine.close()
    return {
        "async_depth": depth,
        "rounds": rounds,
        "json_over_free": statistics.median(ratios),
        # the middle half of the paired ratios: how far one round's hiccup moves a ratio here
        "json_over_free_quartiles": quartiles(ratios),
    }


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles of `values`, interpolated as `bench serve`'s percentiles."""
    return [float(q) for q in np.percentile(values, [25, 75])]


def run(args: argparse.Namespace) -> int:
    from kvtier.model.hf_config import load_model_config

    depths = [int(d) for d in args.depths.split(",")]
    if any(d not in (1, 2, 3) for d in depths) or args.concurrency < 1 or args.rounds < 1:
        raise ValueError("--depths takes 1, 2 or 3; --concurrency and --rounds must be ≥ 1")
    rows = []
    print(
        f"{'model':>18} {'depth':>5} {'free tok/s':>10} {'json tok/s':>10} {'json/free':>9} "
        f"{'quartiles':>13}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = str(models.model_path(name, Path(tmp)))
            vocab = load_model_config(path).vocab_size
            for depth in depths:
                row = {"model": models.label(name)} | run_one(path, vocab, depth, args)
                rows.append(row)
                last = row["rounds"][-1]
                print(
                    f"{row['model']:>18} {depth:>5} "
                    f"{last['free']['output_tokens_per_s']:>10.1f} "
                    f"{last['json_schema']['output_tokens_per_s']:>10.1f} "
                    f"{row['json_over_free']:>9.3f} "
                    "{:>6.3f}–{:<6.3f}".format(*row["json_over_free_quartiles"])
                )
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    saved = save_json({"config": config, "schema": schema(args.min_items), "rows": rows}, args.out)
    print(f"saved {saved}")
    return 0
