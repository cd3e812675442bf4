"""What an 8-bit KV cache costs in quality (docs/kernels.md, "8-bit KV"): the goldens' tiny models of
every architecture (head size 16, and 64 where the native kernel's tile and pairs paths run), run
in bfloat16 with a bfloat16 KV pool and with each fp8 format, the goldens' prompt then 32 teacher-
forced tokens; per KV dtype the mean and max |Δlogit| against the bfloat16 pool and against
float64 `transformers` (the truth), and how often the greedy token agrees with the bfloat16
pool's. Prints a table, saves JSON. Needs `transformers` (the test extra) and runs from a git
checkout (it reuses the goldens' drivers in tests/model/)."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import main
from kvtier.bench import save_json

FORMATS = {"bfloat16": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results/bench_kv_quality.json")


def goldens(name: str) -> Any:
    """A module of the goldens' drivers in tests/model/ (this lab tool runs from a checkout)."""
    return importlib.import_module(f"tests.model.{name}")


def logits_of(
    model: Any, tokens: list[int], prompt_len: int, kv_dtype: torch.dtype | None
) -> torch.Tensor:
    kv = goldens("paged").PagedKV(model, num_blocks=64, block_size=4, kv_dtype=kv_dtype)
    steps = [kv.step([("s", tokens[:prompt_len])])[0]]
    steps += [kv.step([("s", [t])])[0] for t in tokens[prompt_len:]]
    return torch.cat(steps).double()


def run(args: argparse.Namespace) -> int:
    from kvtier.model.loader import load_model
    from kvtier.model.testing import ARCHITECTURES, write_tiny_model

    hf_logits, hf_model = goldens("reference").hf_logits, goldens("reference").hf_model
    prompt, PROMPT_LEN = goldens("test_goldens").prompt, goldens("test_goldens").PROMPT_LEN

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            for head, config in ((16, {}), (64, {"hidden_size": 256})):
                folder = write_tiny_model(Path(tmp) / f"{arch}-{head}", arch, 0, **config)
                tokens = prompt(seed=2) + list(range(40, 72))
                truth = hf_logits(hf_model(folder, torch.float64), tokens)
                model = load_model(folder, dtype="bfloat16")
                out = {n: logits_of(model, tokens, PROMPT_LEN, d) for n, d in FORMATS.items()}
                base = out["bfloat16"]
                for name, logits in out.items():
                    rows.append({
                        "arch": arch, "head_dim": head, "kv_cache_dtype": name,
                        "mean_abs_vs_bf16_kv": float((logits - base).abs().mean()),
                        "max_abs_vs_bf16_kv": float((logits - base).abs().max()),
                        "mean_abs_vs_fp64": float((logits - truth).abs().mean()),
                        "max_abs_vs_fp64": float((logits - truth).abs().max()),
                        "greedy_agreement_vs_bf16_kv":
                            float((logits.argmax(-1) == base.argmax(-1)).float().mean()),
                        "positions": int(logits.shape[0]),
                    })  # fmt: skip
                    r = rows[-1]
                    print(f"{arch:14s} head {head:3d} {name:9s} |Δ| vs bf16 KV mean "
                          f"{r['mean_abs_vs_bf16_kv']:.4f} max {r['max_abs_vs_bf16_kv']:.3f}; "
                          f"vs fp64 mean {r['mean_abs_vs_fp64']:.4f} max "
                          f"{r['max_abs_vs_fp64']:.3f}; greedy agreement "
                          f"{r['greedy_agreement_vs_bf16_kv']:.1%}", flush=True)  # fmt: skip
    summary = {}
    for name in FORMATS:
        sel = [r for r in rows if r["kv_cache_dtype"] == name]
        summary[name] = {
            "mean_abs_vs_bf16_kv": sum(r["mean_abs_vs_bf16_kv"] for r in sel) / len(sel),
            "max_abs_vs_bf16_kv": max(r["max_abs_vs_bf16_kv"] for r in sel),
            "mean_abs_vs_fp64": sum(r["mean_abs_vs_fp64"] for r in sel) / len(sel),
            "greedy_agreement_vs_bf16_kv": sum(r["greedy_agreement_vs_bf16_kv"] for r in sel)
            / len(sel),
            "greedy_agreement_min": min(r["greedy_agreement_vs_bf16_kv"] for r in sel),
        }
        s = summary[name]
        print(f"{name:9s} over {len(sel)} models: |Δ| vs bf16 KV mean {s['mean_abs_vs_bf16_kv']:.4f}"
              f" max {s['max_abs_vs_bf16_kv']:.3f}; vs fp64 mean {s['mean_abs_vs_fp64']:.4f}; "
              f"greedy agreement {s['greedy_agreement_vs_bf16_kv']:.1%} (min "
              f"{s['greedy_agreement_min']:.1%})")  # fmt: skip
    print(f"saved {save_json({'rows': rows, 'summary': summary}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
