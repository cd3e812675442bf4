"""`kvtier generate`: generate text from the command line, streaming it as it is sampled."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from kvtier.cli_args import add_dataclass_args, dataclass_from_args
from kvtier.config import (
    PROTECTIONS,
    QUANTIZATIONS,
    CacheConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    parse_protect,
)

if TYPE_CHECKING:  # the engine pulls in torch: imported when a command runs, not when parsing
    from kvtier.engine.core import EngineCore
    from kvtier.engine.params import EngineArgs, SamplingParams


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate`, `serve` and benchmarks (spelled as vLLM's)."""
    parser.add_argument("--model", default=None, help="local HF model folder (default: embedded)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's; float16 runs as bfloat16 off cuda), float32, bfloat16, "
        "float64, or float16 (cuda only)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="weights' quantization (default: the checkpoint's config.json): compressed-tensors "
        "int8 weights (W8A16 or W8A8), or int8 to quantize a float checkpoint's linears as it "
        "loads (W8A16), or w8a8 to quantize them and their activations per token (W8A8)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "sim", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument(
        "--max-logprobs", type=int, default=20, help="most logprobs a request may ask for"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch kernel threads (default: the usable cores but one, left to the host)",
    )
    parser.add_argument(
        "--protect",
        default=",".join(PROTECTIONS),
        help="block-lifetime protections: any of event,settled,quarantine, or none",
    )
    add_dataclass_args(parser, CacheConfig)
    add_dataclass_args(parser, SchedulerConfig)
    add_dataclass_args(parser, StructuredOutputsConfig)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    from kvtier.engine.params import EngineArgs

    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
        max_logprobs=args.max_logprobs,
        torch_threads=args.torch_threads,
        protect=parse_protect(args.protect),
        cache=dataclass_from_args(CacheConfig, args),
        scheduler=dataclass_from_args(SchedulerConfig, args),
        structured_outputs=dataclass_from_args(StructuredOutputsConfig, args),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvtier.engine.core import EngineCore
    from kvtier.engine.params import SamplingParams

    engine = EngineCore(engine_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    try:
        return _generate(engine, args, params)
    finally:
        engine.close()  # the disk and remote tiers finish their queued writes


def _generate(engine: EngineCore, args: argparse.Namespace, params: SamplingParams) -> int:
    t0 = time.perf_counter()
    ids = []
    for i, prompt in enumerate(args.prompts):
        engine.add_request(f"cli-{i}", engine.tokenizer.encode(prompt), params)
        ids.append(f"cli-{i}")
    stream = len(ids) == 1
    if stream:
        sys.stdout.write(args.prompts[0])
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if stream:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            elif out.result is not None:
                i = ids.index(out.req_id)
                print(f"--- [{i}] {args.prompts[i]!r} ({out.result.finish_reason})")
                print(args.prompts[i] + out.result.text)
    elapsed = time.perf_counter() - t0
    if stream:
        print()
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tokens/s; "
        f"KV: {engine.plan.tiers[0].num_blocks} blocks of {engine.plan.block_size} tokens, "
        f"{len(engine.plan.groups)} groups, max concurrency at max length "
        f"{engine.plan.max_concurrency()} (admission {engine.plan.admission.name})]",
        file=sys.stderr,
    )
    return 0
