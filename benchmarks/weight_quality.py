"""What int8 weights cost in quality (docs/kernels.md, "Linear layers, int8 weights"): the embedded
model (trained, so its distributions are a language model's, not a random one's) in bfloat16 and
in each int8 format as `--quantization` makes it (int8: W8A16, the LM head too; w8a8: the decoder's
linears on int8 activations per token, the LM head W8A16), teacher-forced over the same tokens
(each prompt and the bfloat16 model's greedy continuation): per format how often the top token
agrees with bfloat16's, the mean KL(bf16 ‖ format) and mean |Δlogit|; and how many greedy
continuations stay identical, with their mean common prefix (where a free run first leaves
bfloat16's). Prints a table, saves JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks import main
from benchmarks.kv_quality import goldens
from kvtier.bench import save_json

FORMATS = ("bfloat16", "int8", "w8a8")  # bfloat16: no --quantization
PROMPTS = (
    "The little cat", "Once upon a time", "In the morning the", "She said that",
    "The king and the", "A dog ran", "We went to the", "He looked at the", "It was a dark",
    "The children played", "My mother told me", "The old man", "On the hill there",
    "They found a", "The bird sang", "After the rain",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded one)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens a prompt")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--out", default="results/bench_weight_quality.json")


def _continuations(llm: Any, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's ids followed by its greedy continuation."""
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def _logprobs(model: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's log-probabilities at every position: one prefill each through the paged
    forward the goldens drive (tests/model/paged.py; this lab tool runs from a checkout)."""
    paged = goldens("paged")
    blocks = sum(-(-len(s) // 16) for s in seqs) * len(model.kv_groups) + 1  # + the null block
    kv = paged.PagedKV(model, num_blocks=blocks, block_size=16)
    return [kv.step([(f"s{i}", s)])[0].float().log_softmax(-1) for i, s in enumerate(seqs)]


def run(args: argparse.Namespace) -> int:
    from kvtier.engine import LLM
    from kvtier.engine.params import DEFAULT_MODEL
    from kvtier.model.loader import load_model

    if args.max_tokens < 1 or not 1 <= args.num_prompts <= len(PROMPTS):
        raise ValueError(f"--max-tokens ≥ 1 and 1 ≤ --num-prompts ≤ {len(PROMPTS)}")
    prompts = list(PROMPTS[: args.num_prompts])
    folder = args.model or DEFAULT_MODEL
    free: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[torch.Tensor]] = {}
    for fmt in FORMATS:
        quantization = None if fmt == "bfloat16" else fmt
        llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, num_device_blocks=256,
                  quantization=quantization)  # fmt: skip
        free[fmt] = _continuations(llm, prompts, args.max_tokens)
        del llm
        # every format teacher-forced over the same tokens: bfloat16's continuations
        model = load_model(folder, dtype="bfloat16", quantization=quantization)
        logprobs[fmt] = _logprobs(model, free["bfloat16"])
    rows = []
    for fmt in FORMATS[1:]:
        agree = kl = diff = 0.0
        positions = 0
        for a, b in zip(logprobs[fmt], logprobs["bfloat16"], strict=True):
            agree += float((a.argmax(-1) == b.argmax(-1)).sum())
            kl += float((b.exp() * (b - a)).sum(-1).sum())
            diff += float((a - b).abs().mean(-1).sum())  # log-probabilities: Δlogit less its shift
            positions += a.shape[0]
        prefixes = []
        for ours, base in zip(free[fmt], free["bfloat16"], strict=True):
            start = n = len(ours) - args.max_tokens  # the prompt's ids are the same
            while n < len(ours) and ours[n] == base[n]:
                n += 1
            prefixes.append(n - start)
        rows.append({
            "format": fmt, "positions": positions,
            "top1_agreement": agree / positions, "mean_kl": kl / positions,
            "mean_abs_logprob_diff": diff / positions,
            "identical_continuations": sum(p == args.max_tokens for p in prefixes),
            "continuations": len(prefixes), "mean_common_prefix": sum(prefixes) / len(prefixes),
        })  # fmt: skip
        r = rows[-1]
        print(f"{fmt:5s} vs bfloat16 over {positions} positions: top-1 agreement "
              f"{r['top1_agreement']:.1%}, mean KL {r['mean_kl']:.5f}, mean |Δlogprob| "
              f"{r['mean_abs_logprob_diff']:.4f}; greedy: {r['identical_continuations']}/"
              f"{r['continuations']} identical, common prefix {r['mean_common_prefix']:.1f} of "
              f"{args.max_tokens}", flush=True)  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k != "func"}
    print(f"saved {save_json({'config': config, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
