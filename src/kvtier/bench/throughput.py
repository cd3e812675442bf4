"""Offline throughput: N prompts × P tokens → O greedy output tokens, kvtier beside transformers.

Runs both engines on the same local model folder in the same process and reports output
tokens/s (wall clock), kvtier's cold pass and a warm pass with prefix hits, and how many greedy
completions agree token for token. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench import models, save_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny-llama,default", help=models.HELP)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="kvtier's backend (transformers runs on the same device)",
    )
    parser.add_argument(
        "--sim",
        action="store_true",
        help="also run kvtier on the sim device with the race sanitizer (its overhead vs cpu)",
    )
    parser.add_argument(
        "--protect-cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also run protect=all beside protect=none (cold passes, new prompts each round, "
        "engines alternating) for this many rounds: the protections' cost, same tokens",
    )
    parser.add_argument(
        "--profile",
        metavar="PATH",
        help="profile one cold pass of each model and dtype on the sim device (every op on the "
        "host thread, synchronous) with cProfile: functions by own time to PATH (printed too)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="kvtier's torch threads (default: the engine's choice for the model)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_throughput.json")


def random_prompts(seed: int, num: int, length: int, vocab: int) -> list[list[int]]:
    """`num` prompts of `length` random token ids (ids 0–2 are left out: special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def run_kvtier(
    path: str, dtype: str, prompts: list[list[int]], args: argparse.Namespace, device: str = "cpu"
) -> dict[str, Any]:
    from kvtier.engine import LLM, SamplingParams

    llm = LLM(
        path,
        device=device,
        sanitize=device == "sim",
        dtype=dtype,
        block_size=args.block_size,
        max_model_len=args.input_len + args.output_len + args.block_size,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        torch_threads=args.torch_threads,
    )
    # min_tokens masks EOS until the length is reached, as transformers' min_new_tokens does.
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0)
    batch = [{"prompt_token_ids": p} for p in prompts]
    # First-call costs (oneDNN primitives, kernel loading) are not the cold pass's: warm up on two
    # prompts that share no block with the measured ones.
    warmup = [{"prompt_token_ids": [3 + t % 7 for t in p]} for p in prompts[:2]]
    llm.generate(warmup, params, use_tqdm=False)
    result: dict[str, Any] = {}
    outs: list[list[int]] = []
    for name in ("cold", "warm"):  # the warm pass hits the prefix cache for every prompt
        t0, c0 = time.perf_counter(), time.process_time()
        got = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in got)
        result[name] = {
            "seconds": elapsed,
            "output_tokens": n,
            "output_tokens_per_s": n / elapsed,
            "cores": (time.process_time() - c0) / elapsed,  # CPU-s of every thread per second
        }
        outs = [o.outputs[0].token_ids for o in got]
    result["tokens"] = outs
    result["hazards"] = llm.engine.stats().num_hazards
    return result


def run_protect_cost(path: str, dtype: str, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """protect=all (every block-lifetime protection, the default) beside protect=none on a
    workload where none corrupts nothing (every request fits, none is preempted or aborted):
    round by round, each on new prompts, all then none. Cost = median over rounds of the paired
    ratios tok/s(none) / tok/s(all) − 1 and CPU-s(all) / CPU-s(none) − 1."""
    from kvtier.config import PROTECTIONS
    from kvtier.engine import LLM, SamplingParams

    common = {
        "device": args.device,
        "dtype": dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.num_prompts,
        "max_model_len": args.input_len + args.output_len + args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "torch_threads": args.torch_threads,
    }
    llms = {
        name: LLM(path, protect=p, **common) for name, p in (("all", PROTECTIONS), ("none", ()))
    }
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    rounds: list[dict[str, Any]] = []
    for i in range(args.protect_cost):
        prompts = random_prompts(args.seed + 1000 + i, args.num_prompts, args.input_len, vocab)
        batch = [{"prompt_token_ids": p} for p in prompts]
        result: dict[str, Any] = {}
        for name, llm in llms.items():
            t0, c0 = time.perf_counter(), time.process_time()
            got = llm.generate(batch, params, use_tqdm=False)
            sec, cpu = time.perf_counter() - t0, time.process_time() - c0
            toks = [o.outputs[0].token_ids for o in got]
            num = sum(len(t) for t in toks)
            result[name] = {"tokens": toks, "tok_s": num / sec, "cpu_s": cpu, "output_tokens": num}
        result["same_tokens"] = result["all"]["tokens"] == result["none"]["tokens"]
        for name in llms:
            del result[name]["tokens"]
        rounds.append(result)
    return {
        "rounds": rounds,
        "cost_tok_s": statistics.median(r["none"]["tok_s"] / r["all"]["tok_s"] - 1 for r in rounds),
        "cost_cpu_s": statistics.median(r["all"]["cpu_s"] / r["none"]["cpu_s"] - 1 for r in rounds),
        "same_tokens": all(r["same_tokens"] for r in rounds),
    }


def profile_kvtier(
    path: str, dtype: str, prompts: list[list[int]], args: argparse.Namespace
) -> str:
    """cProfile of one cold pass on the sim device, sanitizer off, one step at a time (the cpu
    backend runs the forward on a worker thread that cProfile does not see); the report sorted
    by own time."""
    import cProfile
    import io
    import pstats

    from kvtier.engine import LLM, SamplingParams

    llm = LLM(path, device="sim", sanitize=False, async_scheduling=False, dtype=dtype,
              block_size=args.block_size, max_num_seqs=args.num_prompts,
              max_model_len=args.input_len + args.output_len + args.block_size,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)  # fmt: skip
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    llm.generate([{"prompt_token_ids": p[:-1]} for p in prompts[:2]], params, use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    return text.getvalue()


def run_transformers(
    path: str, dtype: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device: str = getattr(args, "device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.eval()  # type: ignore[no-untyped-call]
    model.to(torch.device(device))
    ids = torch.tensor(prompts, device=device)  # [num_prompts, input_len]; no padding
    with torch.inference_mode():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=0,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    tokens = out[:, ids.shape[1] :].tolist()
    n = sum(len(t) for t in tokens)
    return {
        "seconds": elapsed,
        "output_tokens": n,
        "output_tokens_per_s": n / elapsed,
        "tokens": tokens,
    }


def run(args: argparse.Namespace) -> int:
    from kvtier.model.hf_config import load_model_config

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = models.model_path(name, Path(tmp))
            cfg = load_model_config(path)
            prompts = random_prompts(args.seed, args.num_prompts, args.input_len, cfg.vocab_size)
            for dtype in args.dtypes.split(","):
                ours = run_kvtier(str(path), dtype, prompts, args, device=args.device)
                row: dict[str, Any] = {
                    "model": models.label(name),
                    "architecture": cfg.architecture,
                    "dtype": dtype,
                    "kvtier_cold_tok_s": ours["cold"]["output_tokens_per_s"],
                    "kvtier_warm_tok_s": ours["warm"]["output_tokens_per_s"],
                    "kvtier": {k: v for k, v in ours.items() if k != "tokens"},
                }
                if args.sim:
                    sim = run_kvtier(str(path), dtype, prompts, args, device="sim")
                    row["kvtier_sim_sanitized_tok_s"] = sim["cold"]["output_tokens_per_s"]
                    row["sim_overhead"] = (
                        row["kvtier_cold_tok_s"] / sim["cold"]["output_tokens_per_s"] - 1
                    )
                    row["sim_same_tokens"] = sim["tokens"] == ours["tokens"]
                    row["sim_hazards"] = sim["hazards"]
                if args.profile:
                    report = profile_kvtier(str(path), dtype, prompts, args)
                    out = Path(args.profile)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with out.open("a") as f:
                        f.write(f"== {models.label(name)} {dtype}\n{report}\n")
                    print("\n".join(report.splitlines()[:25]), flush=True)
                if args.protect_cost:
                    cost = run_protect_cost(str(path), dtype, cfg.vocab_size, args)
                    row["protect_cost"] = cost
                    print(
                        f"{models.label(name):12s} {dtype:9s} protections' cost (all vs none, "
                        f"{args.protect_cost} rounds): tok/s {cost['cost_tok_s']:+.1%}, CPU-s "
                        f"{cost['cost_cpu_s']:+.1%}, same tokens: {cost['same_tokens']}",
                        flush=True,
                    )
                if not args.no_transformers:
                    ref = run_transformers(str(path), dtype, prompts, args)
                    same = sum(a == b for a, b in zip(ours["tokens"], ref["tokens"], strict=True))
                    row["transformers_tok_s"] = ref["output_tokens_per_s"]
                    row["transformers"] = {k: v for k, v in ref.items() if k != "tokens"}
                    row["speedup_vs_transformers"] = (
                        row["kvtier_cold_tok_s"] / ref["output_tokens_per_s"]
                    )
                    row["identical_completions"] = f"{same}/{len(prompts)}"
                rows.append(row)
                print(
                    f"{models.label(name):12s} {dtype:9s} kvtier cold {row['kvtier_cold_tok_s']:8.1f} tok/s  "
                    f"warm {row['kvtier_warm_tok_s']:8.1f} tok/s  cores used "
                    f"{ours['cold']['cores']:.2f} · {ours['warm']['cores']:.2f}"
                    + (
                        f"  sim+sanitizer {row['kvtier_sim_sanitized_tok_s']:8.1f} tok/s "
                        f"(+{row['sim_overhead']:.1%}, same tokens: {row['sim_same_tokens']})"
                        if "sim_overhead" in row
                        else ""
                    )
                    + (
                        f"  transformers {row['transformers_tok_s']:8.1f} tok/s  "
                        f"×{row['speedup_vs_transformers']:.2f}  same {row['identical_completions']}"
                        if "transformers_tok_s" in row
                        else ""
                    ),
                    flush=True,
                )
    workload = {
        k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "block_size")
    }
    print(
        f"saved {save_json({'workload': workload, 'threads': torch.get_num_threads(), 'rows': rows}, args.out)}"
    )
    return 0
