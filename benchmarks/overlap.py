"""Overlap on the threaded cpu backend: how much host time (scheduling, output processing,
detokenizing) hides behind the forward, per step, at async depth 1 (the host waits for every
step: nothing overlaps, as on the old synchronous backend at any depth) and at depths 2 and 3.

Per run the device reports its compute stream's busy time D and the host's time blocked in
synchronisations B (`ThreadedDevice.times()`); with wall time W the host was busy H = W − B, and
while it waited the forward ran, so the host work hidden behind forwards is D − B. Rounds
alternate between depths (the machine is shared); each row is the median over rounds. Prints a
table, saves JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import main
from kvtier.bench import save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="tiny-llama, default, or a folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--depths", default="1,2,3")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_overlap.json")


def measure(llm: Any, batch: list[dict[str, Any]], params: Any) -> dict[str, Any]:
    """One timed `generate` on a warm engine: per-step wall, forward, host busy, hidden."""
    engine = llm.engine
    t0, s0 = engine.device.times(), engine.stats().num_steps
    w0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - w0
    t1, steps = engine.device.times(), engine.stats().num_steps - s0
    forward = t1.busy_s.get("compute", 0.0) - t0.busy_s.get("compute", 0.0)
    waited = t1.host_wait_s - t0.host_wait_s
    host = wall - waited
    hidden = max(0.0, forward - waited)
    tokens = [o.outputs[0].token_ids for o in outs]
    ms = 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall * ms,
        "forward_ms_per_step": forward * ms,
        "host_ms_per_step": host * ms,
        "hidden_ms_per_step": hidden * ms,
        "hidden_share_of_host": hidden / host if host > 0 else 0.0,
        "output_tok_s": sum(len(t) for t in tokens) / wall,
        "tokens": tokens,
    }


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import models
    from kvtier.bench.throughput import random_prompts
    from kvtier.engine import LLM, SamplingParams
    from kvtier.model.hf_config import load_model_config

    depths = [int(d) for d in args.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = models.model_path(args.model, Path(tmp))
        vocab = load_model_config(path).vocab_size
        n = args.output_len
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
        engines = {
            d: LLM(
                str(path),
                device="cpu",
                dtype=args.dtype,
                async_depth=d,
                enable_prefix_caching=False,  # every round computes every prompt
                max_model_len=args.input_len + n + 16,
                max_num_seqs=args.num_prompts,
                max_num_batched_tokens=max(2048, args.input_len * 4),
                torch_threads=args.torch_threads,
                seed=args.seed,
            )
            for d in depths
        }
        warm = [
            {"prompt_token_ids": p} for p in random_prompts(args.seed, 4, args.input_len, vocab)
        ]
        for llm in engines.values():
            measure(llm, warm, params)
        runs: dict[int, list[dict[str, Any]]] = {d: [] for d in depths}
        for r in range(args.rounds):
            prompts = random_prompts(args.seed + 1 + r, args.num_prompts, args.input_len, vocab)
            batch = [{"prompt_token_ids": p} for p in prompts]
            for d in depths:
                runs[d].append(measure(engines[d], batch, params))
    rows = []
    for d in depths:
        keys = [k for k in runs[d][0] if k not in ("tokens", "steps")]
        row: dict[str, Any] = {"async_depth": d, "steps": runs[d][0]["steps"]}
        row |= {k: statistics.median(x[k] for x in runs[d]) for k in keys}
        row["same_tokens_as_depth_1"] = all(
            x["tokens"] == y["tokens"] for x, y in zip(runs[d], runs[depths[0]], strict=True)
        )
        rows.append(row)
        print(
            f"depth {d}: per step wall {row['wall_ms_per_step']:6.2f} ms  forward "
            f"{row['forward_ms_per_step']:6.2f}  host busy {row['host_ms_per_step']:5.2f}  "
            f"hidden {row['hidden_ms_per_step']:5.2f} ({row['hidden_share_of_host']:4.0%} of the "
            f"host's)  {row['output_tok_s']:7.1f} tok/s  same tokens: "
            f"{row['same_tokens_as_depth_1']}",
            flush=True,
        )
    config = {k: v for k, v in vars(args).items()}
    print(f"saved {save_json({'config': config, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
