"""The sampler's cost per step: `model.sampler.sample` on a batch of logits, for each sampling
setting, row count and vocabulary size, through the native kernels (the host's path: argmax, the
top-k / top-p select, the draw) and through torch's ops alone (the path off the host: softmax,
cumulative sum and search, a sort or `topk` for the filters), alternating round by round on the
same logits. Logits are normal with `--scale` standard deviation (3: most of a row's mass on a
few hundred tokens at 151,936; smaller is flatter, where top-p keeps more). Each cell is the
median over rounds; the sampler is handed its logits (a fresh copy each call), as the engine
hands them. Prints a table, saves JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks import main
from kvtier.bench import save_json

SETTINGS: dict[str, dict[str, Any]] = {  # name → DrawParams fields
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "seeded": {"temperature": 1.0, "seed": 7},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "top_p": {"temperature": 0.7, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 151936])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"results/bench_sampler_{time.strftime('%Y-%m-%d')}.json")


@contextlib.contextmanager
def torch_only() -> Iterator[None]:
    """The sampler without the native kernels: each entry answers as where they do not serve."""
    from kvtier.model import native

    saved = native.argmax, native.top_k_top_p_, native.draw
    native.argmax = lambda x: x.argmax(dim=-1)
    native.top_k_top_p_ = lambda x, top_k, top_p: None
    native.draw = lambda x, u: None
    try:
        yield
    finally:
        native.argmax, native.top_k_top_p_, native.draw = saved


def time_sample(logits: torch.Tensor, params: Any, repeats: int) -> float:
    """Median seconds of `sample` on fresh copies of `logits`, after one untimed call."""
    from kvtier.model.sampler import SamplingBatch, sample

    n, vocab = logits.shape
    batch = SamplingBatch.from_params([params] * n, list(range(n)), vocab)
    gen = torch.Generator().manual_seed(0)
    times = []
    for r in range(repeats + 1):
        copy = logits.clone()
        t0 = time.perf_counter()
        sample(copy, batch, gen, consume=True)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from kvtier.model import native
    from kvtier.sampling import DrawParams

    if native.kernels() is None:
        raise SystemExit("the native kernels are not built here: nothing to compare")
    if min(args.rows) < 1 or min(args.vocab) < 2 or args.rounds < 1:
        raise ValueError("--rows ≥ 1, --vocab ≥ 2 and --rounds ≥ 1")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"{'setting':>12} {'rows':>5} {'vocab':>7} {'native ms':>10} {'torch ms':>9} {'×':>6}")
    for vocab in args.vocab:
        for n in args.rows:
            logits = torch.randn(n, vocab, generator=gen) * args.scale
            repeats = max(3, min(20, int(2e6 / (n * vocab))))  # ~a second a cell at most
            for name in args.settings:
                params = DrawParams(**SETTINGS[name])
                ours, theirs = [], []
                for _ in range(args.rounds):
                    ours.append(time_sample(logits, params, repeats))
                    with torch_only():
                        theirs.append(time_sample(logits, params, repeats))
                a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
                rows.append({"setting": name, "rows": n, "vocab": vocab, "native_ms": a,
                             "torch_ms": b, "native_ms_rounds": [t * 1e3 for t in ours],
                             "torch_ms_rounds": [t * 1e3 for t in theirs]})  # fmt: skip
                print(
                    f"{name:>12} {n:>5} {vocab:>7} {a:>10.3f} {b:>9.3f} {b / a:>6.2f}", flush=True
                )
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    config["settings"] = {k: SETTINGS[k] for k in args.settings}
    print(f"saved {save_json({'config': config, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
