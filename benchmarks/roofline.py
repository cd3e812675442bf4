"""`kvtier bench roofline`: how close decode comes to the memory-bandwidth limit. A decode step must
read every weight once and each sequence's KV; at this machine's copy bandwidth (measured here: a
large tensor copy, bytes read + written per second, before every batch size; the best of the run
is every row's) that takes `roofline_ms`. The engine's decode
step time is timed on the engine's own steps once every prompt of the batch is prefilled (new
prompts each round): elapsed time over decode steps. Reports the fraction of the
roofline reached (roofline_ms / step_ms) per batch size; prints a table and saves JSON.

A large batch is bound by arithmetic, not memory: every weight multiplies every row. So it also
reports `compute_ms`, the step's multiply-adds (weights × rows, plus attention's) at this
machine's measured bfloat16 matmul rate (the best of oneDNN's and the tile kernel's large linear,
measured before every batch size: the best the CPU's matrix instructions gave in the run), and the
fraction of the higher of the two bounds (`fraction_of_bound`); the linears with int8 activations
(`w8a8_macs`) count at the W8A8 kernel's rate, measured the same way. On a shared machine either
measurement can catch a slow minute; the best of the run is the closest to what the hardware gives.

Where a step's time goes is the question a missed roofline raises, so each batch size also times
the model's linear layers alone on that many rows (`linear_ms`: every `Linear` once, through the
same kernels as the step) against their weights' bytes at the copy bandwidth; `rest_ms` is the
step's other work (attention, norms and activations, sampling, what the host adds): a difference
of two medians, each round's linears timed right after its steps, so near zero, even a little
below, where the step is all linears (batch 1; the pass also pays a Python call a layer that the
step's one-call layers do not).

`--weights` compares weight formats in one run, each batch size's rows side by side (the box's
load moves from minute to minute): bfloat16, `int8` (the model written as a compressed-tensors
int8 checkpoint, W8A16, its LM head in bfloat16 as llm-compressor leaves it) and `int8-all`
(that folder with `--quantization int8`, the LM head too), `w8a8` (the model written as a
compressed-tensors W8A8 checkpoint, activations int8 per token, LM head in bfloat16) and
`w8a8-int8-head` (that folder with `--quantization int8`: the LM head int8, its inputs
bfloat16); `speedup` is a row's tok/s over the first format's at its batch size."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import main
from kvtier.bench import models, save_json
from kvtier.bench.throughput import random_prompts
from kvtier.engine.threads import configure_torch_threads
from kvtier.model import native
from kvtier.model.layers import Linear
from kvtier.model.quant import W8A8_ACTIVATIONS, Int8Linear
from kvtier.model.served import ServedDecoder
from kvtier.model.testing import write_int8_model

WEIGHTS = ("bfloat16", "int8", "int8-all", "w8a8", "w8a8-int8-head")  # --weights: compared


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.QWEN2_05B, help=models.HELP)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="the KV pool's dtype (auto: --dtype; fp8: 8-bit)"
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["bfloat16"],
        choices=WEIGHTS,
        help="weight formats compared in one run: bfloat16 (the model's dtype), int8 (a "
        "compressed-tensors W8A16 copy, LM head in --dtype), int8-all (the LM head too), w8a8 (a "
        "W8A8 copy: int8 activations per token, LM head in --dtype), w8a8-int8-head (its LM "
        "head int8 with --dtype inputs)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per batch size")
    parser.add_argument("--copy-mib", type=int, default=512, help="size of the copied tensor")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the copy and the engine (default: the engine's choice for the model)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_roofline.json")


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes read + written per second by the best of `repeats` copies of a `mib` MiB tensor."""
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def _best_seconds(paths: list[Callable[[], object]], repeats: int) -> float:
    """The fastest of `repeats` calls of each path, after one call each (packing, warm-up)."""
    best = float("inf")
    for path in paths:
        path()
        for _ in range(repeats):
            t0 = time.perf_counter()
            path()
            best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(dtype: torch.dtype, repeats: int = 5) -> float:
    """Multiply-adds per second of the best of `repeats` large linears ([512, 4096] by a
    [4096, 4096] weight) through `Linear` as the model's run (bfloat16: oneDNN's prepacked layout
    at this size) and, in bfloat16 where it is built, through the tile kernel the model's decode
    linears use (`native.Kernels.linear_bf16`): the rate no step's matrix products beat here."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4096, generator=gen).to(dtype)
    w = torch.randn(4096, 4096, generator=gen).to(dtype)
    layer = Linear(4096, 4096, bias=False).to(dtype)
    kernels = native.kernels()
    with torch.no_grad():
        layer.weight.copy_(w)
        paths: list[Callable[[], object]] = [lambda: layer(x)]
        if dtype == torch.bfloat16 and kernels is not None and kernels.tile_linear:
            tiles = layer.tiles(kernels)
            paths.append(lambda: kernels.linear_bf16(x, tiles, 4096, None))
        best = _best_seconds(paths, repeats)
    return x.shape[0] * w.numel() / best


def w8a8_rate(repeats: int = 5) -> float:
    """Multiply-adds per second of the best of `repeats` large W8A8 linears (as `matmul_rate`'s,
    int8 weights, bfloat16 activations quantized per row) through `Int8Linear`, as the model's
    run: on the W8A8 kernel where it is built (VPDPBUSD does twice VDPBF16PS's multiply-adds an
    instruction, so a W8A8 linear's arithmetic is bounded at this rate, not at the bfloat16
    one), else in torch ops."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4096, generator=gen).to(torch.bfloat16)
    layer = Int8Linear(4096, 4096, bias=False, int8_activations=True)
    layer.weight.data = torch.randint(-127, 128, (4096, 4096), generator=gen, dtype=torch.int8)
    layer.weight_scale.data = torch.full((4096,), 1e-3)
    with torch.no_grad():
        best = _best_seconds([lambda: layer(x)], repeats)
    return x.shape[0] * layer.weight.numel() / best


def linears(model: torch.nn.Module) -> list[Linear | Int8Linear]:
    """The model's linear layers, each weight once (a tied LM head is the embedding's table)."""
    seen: set[int] = set()
    found: list[Linear | Int8Linear] = []
    for module in model.modules():
        if isinstance(module, (Linear, Int8Linear)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found.append(module)
    return found


def linear_pass_s(
    layers: list[Linear | Int8Linear], batch: int, dtype: torch.dtype, repeats: int = 5
) -> float:
    """Seconds of one pass over `layers` on `batch` rows of random `dtype` input each (the median
    of `repeats` passes after a warm-up): the decode step's matrix products alone, through the
    same kernels (plus a Python call each, a few µs, which the step's one-call layers do not)."""
    gen = torch.Generator().manual_seed(0)
    widths = sorted({m.in_features for m in layers})
    xs = {n: torch.randn(batch, n, generator=gen).to(dtype) for n in widths}
    times = []
    with torch.no_grad():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for layer in layers:
                layer(xs[layer.in_features])
            if r:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_macs(model: Any, batch: int, weights: int, kv: float, kv_element: int) -> float:
    """Multiply-adds of one decode step: each row by every weight element read (`weights`), and
    each query head by its KV head's keys and values over the context (from `kv_bytes`,
    `kv_element` bytes an element)."""
    cfg = model.config
    return float(batch * weights + kv / kv_element * cfg.num_heads / cfg.num_kv_heads)


def weight_bytes(model: torch.nn.Module, tied: bool, elements: bool = False) -> int:
    """Bytes (or with `elements`, elements) of every weight a decode step reads (each tensor once;
    an embedding table the LM head does not multiply by is only indexed, so it is left out)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or (name.endswith("embed_tokens.weight") and not tied):
            continue
        seen.add(id(p))
        total += p.numel() * (1 if elements else p.element_size())
    return total


def weights_folder(path: Path, weights: str, tmp: Path) -> tuple[Path, str | None]:
    """The folder and `--quantization` of a `--weights` format for the model at `path`."""
    if weights == "bfloat16":
        return path, None
    w8a8 = weights.startswith("w8a8")
    folder = tmp / ("w8a8" if w8a8 else "int8")
    if not folder.is_dir():
        write_int8_model(path, folder, activations=dict(W8A8_ACTIVATIONS) if w8a8 else None)
    return folder, "int8" if weights in ("int8-all", "w8a8-int8-head") else None


def kv_bytes(model: Any, batch: int, context: float, element_bytes: int) -> float:
    """KV bytes one decode step reads: every layer's keys and values over its readable context
    (`element_bytes` an element of the KV pool)."""
    cfg = model.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * element_bytes
    total = 0.0
    for g, kind in enumerate(model.group_kinds):
        span = context if kind.window is None else min(context, kind.window)
        if kind.chunk is not None:
            span = min(context, kind.chunk / 2)  # on average half a chunk is behind a query
        total += model.layer_group.count(g) * span * per_token
    return batch * total


def decode_step_s(llm: Any, batch: int, args: argparse.Namespace, vocab: int, seed: int) -> float:
    """Seconds per decode step: `batch` new prompts are prefilled, then the engine's steps are
    timed until every request has its output_len tokens (all decode, batch rows each)."""
    from kvtier.engine import SamplingParams

    engine = llm.engine
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    ids = [f"roofline-{seed}-{i}" for i in range(batch)]
    for req_id, prompt in zip(ids, random_prompts(seed, batch, args.input_len, vocab), strict=True):
        engine.add_request(req_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill: until every request has its first token
        started.update(out.req_id for out in engine.step() if out.new_token_ids)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - t0
    return elapsed / max(tokens / batch, 1.0)


def with_bounds(
    row: dict[str, Any], bandwidth: float, rate: float, int8_rate: float | None = None
) -> dict[str, Any]:
    """`row`'s timings (step, linears) against the bounds at the run's best copy bandwidth and
    matmul rates (bfloat16, and W8A8's for the linears with int8 activations): the roofline, the
    compute bound, and the fractions of them reached."""
    step, linear = row["step_ms"] / 1e3, row["linear_ms"] / 1e3
    roofline = (row["weight_bytes"] + row["kv_bytes"]) / bandwidth
    int8_macs = row.get("w8a8_macs", 0.0)
    if int8_macs and int8_rate is None:
        raise ValueError("rows with W8A8 linears need the W8A8 kernel's rate")
    compute = (row["macs"] - int8_macs) / rate + (int8_macs / int8_rate if int8_macs else 0.0)
    return row | {
        "roofline_ms": roofline * 1e3,
        "fraction_of_roofline": roofline / step,
        "compute_ms": compute * 1e3,
        "fraction_of_bound": max(roofline, compute) / step,
        "linear_roofline_ms": row["linear_bytes"] / bandwidth * 1e3,
        "linear_fraction_of_roofline": row["linear_bytes"] / bandwidth / linear,
    }


def measure(
    args: argparse.Namespace,
    path: Path,
    quantization: str | None,
    batch: int,
    threads: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """One row: the decode step and the linears alone of the model at `path` at `batch` rows."""
    from kvtier.config import DTYPE_BYTES, CacheConfig
    from kvtier.engine import LLM

    kv_element = DTYPE_BYTES[CacheConfig(kv_cache_dtype=args.kv_cache_dtype).kv_dtype(args.dtype)]
    llm = LLM(str(path), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, max_num_seqs=batch,
              max_model_len=args.input_len + args.output_len + args.block_size,
              max_num_batched_tokens=max(batch * args.input_len, 256), seed=args.seed,
              torch_threads=threads, quantization=quantization)  # fmt: skip
    served = llm.engine.model
    if not isinstance(served, ServedDecoder):
        raise ValueError(f"{path}: bench roofline models decoders, not Mamba2 hybrids")
    model = served.decoder
    vocab = model.config.vocab_size
    context = args.input_len + args.output_len / 2  # mean over the decode steps
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    weights = weight_bytes(model, tied)
    kv = kv_bytes(model, batch, context, kv_element)
    layers = linears(model)
    steps, passes = [], []
    for r in range(args.rounds):  # the linears alone right after each round's steps
        steps.append(decode_step_s(llm, batch, args, vocab, args.seed + 100 * r))
        passes.append(linear_pass_s(layers, batch, dtype))
    step, linear = statistics.median(steps), statistics.median(passes)
    scales = [m.weight_scale for m in layers if isinstance(m, Int8Linear)]
    int8_acts = [m for m in layers if isinstance(m, Int8Linear) and m.int8_activations]
    linear_bytes = sum(p.numel() * p.element_size() for p in [m.weight for m in layers] + scales)
    return {
        "batch": batch,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "step_ms": step * 1e3,
        "step_ms_rounds": [s * 1e3 for s in steps],
        "macs": step_macs(model, batch, weight_bytes(model, tied, elements=True), kv, kv_element),
        "w8a8_macs": float(batch * sum(m.weight.numel() for m in int8_acts)),
        "linear_bytes": linear_bytes,
        "linear_ms": linear * 1e3,
        "linear_ms_rounds": [s * 1e3 for s in passes],
        "rest_ms": (step - linear) * 1e3,
        "output_tok_s": batch / step,
        "torch_threads": llm.engine.torch_threads,
    }


def run(args: argparse.Namespace) -> int:
    if args.output_len < 2 or args.rounds < 1 or min(args.batch_sizes) < 1:
        raise ValueError("--output-len must be ≥ 2, --rounds and --batch-sizes ≥ 1")
    rows = []
    bandwidths: list[float] = []
    rates: list[float] = []
    int8_rates: list[float] = []  # the W8A8 kernel's, where a format runs it
    w8a8 = any(w.startswith("w8a8") for w in args.weights)
    with tempfile.TemporaryDirectory() as tmp:
        path = models.model_path(args.model, Path(tmp))
        threads = configure_torch_threads(args.threads, path)  # the engine's choice unless told
        dtype = getattr(torch, args.dtype)
        for batch in args.batch_sizes:
            # the box's load moves from minute to minute: the bounds are measured before every
            # batch size and the best of the run taken for all (after the loop)
            bandwidths.append(copy_bandwidth(args.copy_mib))
            rates.append(matmul_rate(dtype))
            if w8a8:
                int8_rates.append(w8a8_rate())
            base = None  # the first format's row at this batch size
            for weights in args.weights:
                folder, quantization = weights_folder(path, weights, Path(tmp))
                row = measure(args, folder, quantization, batch, threads, dtype)
                base = base or row
                speedup = row["output_tok_s"] / base["output_tok_s"]
                rows.append(row | {"weights": weights, "speedup": speedup})
                print(f"batch {batch:3d} {weights:>8}: decode step {row['step_ms']:7.2f} ms "
                      f"({row['output_tok_s']:.0f} tok/s, ×{rows[-1]['speedup']:.2f}), linears "
                      f"alone {row['linear_ms']:7.2f} ms", flush=True)  # fmt: skip
    bandwidth, rate = max(bandwidths), max(rates)
    int8_rate = max(int8_rates) if int8_rates else None
    print(f"copy bandwidth: {bandwidth / 1e9:.2f} GB/s (read + write, {threads} thread(s)); "
          f"{args.dtype} matmul {2 * rate / 1e12:.2f} TFLOP/s (the best of the run)"
          + (f"; W8A8 {2 * int8_rate / 1e12:.2f} TOP/s" if int8_rate else ""))  # fmt: skip
    rows = [with_bounds(row, bandwidth, rate, int8_rate) for row in rows]
    for row in rows:
        print(
            f"batch {row['batch']:3d} {row['weights']}: {(row['weight_bytes'] + row['kv_bytes']) / 1e6:7.1f} MB/step "
            f"(KV {row['kv_bytes'] / 1e6:.1f}) → roofline {row['roofline_ms']:7.2f} ms, decode "
            f"step {row['step_ms']:7.2f} ms → {row['fraction_of_roofline']:.0%} of the roofline; "
            f"compute bound {row['compute_ms']:.2f} ms → {row['fraction_of_bound']:.0%} of the "
            f"higher bound\n           linears alone {row['linear_ms']:7.2f} ms "
            f"({row['linear_ms'] / row['step_ms']:.0%} of the step) against their "
            f"{row['linear_bytes'] / 1e6:.1f} MB's {row['linear_roofline_ms']:.2f} ms → "
            f"{row['linear_fraction_of_roofline']:.0%} of their roofline; the rest of the "
            f"step {row['rest_ms']:.2f} ms"
        )
    config = {k: v for k, v in vars(args).items() if k != "func"}
    payload = {
        "config": config,
        "threads": threads,
        "copy_bandwidth_bytes_s": bandwidth,
        "copy_bandwidth_samples": bandwidths,
        "matmul_macs_s": rate,
        "matmul_macs_s_samples": rates,
        "w8a8_macs_s": int8_rate,
        "w8a8_macs_s_samples": int8_rates,
        "rows": rows,
    }
    print(f"saved {save_json(payload, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
