"""Runs inside the vLLM venv (never imports kvtier): vLLM's v1 Scheduler driven by a fabricated
ModelRunnerOutput, the workload of `kvtier bench sched`; prints one JSON object on stdout.

Every request arrives at t=0 with a unique prompt; each step is schedule() → fabricated output →
update_from_output(), synchronous (one step in flight), and only those two calls are timed.
Partial prefill chunks sample nothing, as vLLM's runner discards their tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

PHASES = ("prefill", "decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="local HF model folder (only its config is read)")
    p.add_argument("--num-requests", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--window", type=int, default=256, help="sliding window of the hybrid spec")
    p.add_argument("--specs", nargs="+", default=["full"], choices=["full", "hybrid"])
    p.add_argument("--hash", default="sha256", help="prefix_caching_hash_algo")
    p.add_argument("--no-prefix-caching", action="store_true")
    return p.parse_args(argv)


def phase(num_scheduled: dict[str, int], num_new_reqs: int, spec: dict[str, list[int]]) -> str:
    """ "prefill" if the step carries any prompt chunk, else "decode" (as `kvtier bench sched`)."""
    if num_new_reqs:
        return "prefill"
    for req_id, n in num_scheduled.items():
        if n - len(spec.get(req_id, ())) > 1:
            return "prefill"
    return "decode"


def summary(steps: list[tuple[str, int, float, float]]) -> dict[str, Any]:
    """Steps are (phase, scheduled requests, schedule s, update s); the keys of kvtier's."""
    live = [s for s in steps if s[1] > 0]
    if not live:
        return {"num_steps": 0}
    per_step = [(s[2] + s[3]) * 1e6 for s in live]
    return {
        "num_steps": len(live),
        "median_reqs_per_step": statistics.median(s[1] for s in live),
        "median_us_per_step": statistics.median(per_step),
        "median_us_per_request_step": statistics.median((s[2] + s[3]) * 1e6 / s[1] for s in live),
        "median_us_schedule_per_request": statistics.median(s[2] * 1e6 / s[1] for s in live),
        "median_us_update_per_request": statistics.median(s[3] * 1e6 / s[1] for s in live),
        "mean_us_per_request_step": sum(per_step) / sum(s[1] for s in live),
    }


def fabricate(output: Any, requests: dict[str, Any], runner_output_cls: Any) -> Any:
    """The ModelRunnerOutput a runner would return for `output`: one token per request whose
    prompt is complete after this step, none for a partial prefill chunk."""
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = requests[req_id]
        done = req.num_computed_tokens >= req.num_prompt_tokens  # advanced by schedule()
        sampled.append([(hash(req_id) + req.num_tokens * 7919) % 32000] if done else [])
    return runner_output_cls(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def build_scheduler(args: argparse.Namespace, kind: str) -> tuple[Any, Any]:
    """vLLM's Scheduler as EngineCore builds it, with a hand-made KV cache config of
    --num-blocks; returns (scheduler, request factory)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    bs = args.block_size
    engine_args = EngineArgs(
        model=args.model,
        skip_tokenizer_init=True,
        max_model_len=args.prompt_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=bs,
        enable_prefix_caching=not args.no_prefix_caching,
        prefix_caching_hash_algo=args.hash,
        async_scheduling=False,
        enforce_eager=True,
    )
    config = engine_args.create_engine_config()
    config.cache_config.block_size = bs  # the platform may round it; the fake runner does not care
    config.cache_config.num_gpu_blocks = args.num_blocks
    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layers.0"], full)]
    if kind == "hybrid":
        swa = SlidingWindowSpec(
            block_size=bs,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.float32,
            sliding_window=args.window,
        )
        groups.append(KVCacheGroupSpec(["layers.1"], swa))
    kv_config = KVCacheConfig(
        num_blocks=args.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=bs,
        hash_block_size=bs,
        log_stats=False,
    )
    hasher = None
    if not args.no_prefix_caching:
        hash_fn = get_hash_fn_by_name(args.hash)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(bs, hash_fn)

    def make_request(i: int) -> Any:
        base = (i + 1) * 1_000_003
        prompt = [(base + j * 7919) % 50_000 for j in range(args.prompt_len)]  # unique prefixes
        sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        return Request(f"req-{i}", prompt, sp, None, block_hasher=hasher)

    return scheduler, make_request


def run_one(args: argparse.Namespace, kind: str, num_requests: int) -> dict[str, Any]:
    from vllm.v1.outputs import ModelRunnerOutput

    sched, make_request = build_scheduler(args, kind)
    for i in range(num_requests):
        sched.add_request(make_request(i))
    steps: list[tuple[str, int, float, float]] = []
    clock = time.perf_counter
    gc.collect()
    start = clock()
    while sched.has_unfinished_requests():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        result = fabricate(out, sched.requests, ModelRunnerOutput)
        t2 = clock()
        sched.update_from_output(out, result)
        t3 = clock()
        new = len(out.scheduled_new_reqs)
        spec = out.scheduled_spec_decode_tokens
        steps.append(
            (phase(out.num_scheduled_tokens, new, spec), len(result.req_ids), t1 - t0, t3 - t2)
        )
    wall = clock() - start
    return {
        "spec": kind,
        "mode": "sync",
        "num_requests": num_requests,
        "num_steps": len(steps),
        "num_preemptions": None,
        "wall_s": wall,
        "host_s": sum(s[2] + s[3] for s in steps),
        **{p: summary([s for s in steps if s[0] == p]) for p in PHASES},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import vllm

    results = [run_one(args, kind, n) for kind in args.specs for n in args.num_requests]
    json.dump({"engine": "vllm", "version": vllm.__version__, "results": results}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
