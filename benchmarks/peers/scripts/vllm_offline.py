"""Runs inside the vLLM venv (never imports kvtier): vLLM's offline `LLM.generate` on token-id
prompts, kept loaded between rounds so a driver can alternate engines.

Loads the model once and prints a JSON line {"kind": "ready", ...}; then reads one JSON line per
round on stdin, {"prompts": [[ids]...], "max_tokens": N} (and optionally "temperature", "top_p",
"top_k"), runs a cold pass (new prompts) and a warm pass (the same prompts again: prefix hits),
greedy unless asked to sample, with min_tokens = max_tokens, and prints a JSON
line {"kind": "round", "cold": {...}, "warm": {...}, "tokens": [...]}. EOF ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=None, help="default: vLLM's choice")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout (vLLM's own logs go to stderr)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def timed_pass(llm: Any, prompts: list[Any], params: Any) -> tuple[dict[str, float], list[Any]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    return {"seconds": seconds, "output_tokens": n, "output_tokens_per_s": n / seconds}, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        **kwargs,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    emit(
        {
            "kind": "ready",
            "engine": "vllm",
            "version": vllm.__version__,
            "load_s": time.perf_counter() - t0,
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        n = int(req["max_tokens"])
        params = SamplingParams(  # greedy unless the round asks for sampling
            max_tokens=n,
            min_tokens=n,
            temperature=float(req.get("temperature", 0.0)),
            top_p=float(req.get("top_p", 1.0)),
            top_k=int(req.get("top_k", 0)),
        )
        prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
        cold, tokens = timed_pass(llm, prompts, params)
        warm, _ = timed_pass(llm, prompts, params)
        emit({"kind": "round", "cold": cold, "warm": warm, "tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
