"""Device-layer overhead: ops/s of the sim and cpu backends with and without the sanitizer.

Runs a representative async-depth-2 step program (loads, forward, stores, sampled-token copy,
events, host syncs) with no-op effects so only the device layer is timed, and compares the
sanitizer's cost per step with the wall time of a stand-in tiny-model decode step."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import main
from kvtier.bench import save_json
from kvtier.device import (
    COMPUTE,
    DEFAULT_STREAMS,
    LOAD,
    STORE,
    AccessSet,
    Backend,
    Device,
    KVLayout,
    OpMeta,
    Sanitizer,
    SanitizerMode,
    Work,
    make_device,
)


@dataclass(frozen=True)
class StepShape:
    """One step of the tiny workload: requests, their blocks and the per-step copies."""

    num_reqs: int = 8
    blocks_per_req: int = 16
    num_loads: int = 2
    num_stores: int = 2
    num_layers: int = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=2000, help="steps per configuration")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (best is kept)")
    parser.add_argument("--num-reqs", type=int, default=8, help="requests per step")
    parser.add_argument("--blocks-per-req", type=int, default=16, help="KV blocks each reads")
    parser.add_argument("--seed", type=int, default=0, help="sim jitter seed")
    parser.add_argument("--out", default="results/bench_device.json", help="JSON output path")


def _noop() -> None:
    pass


def run_steps(dev: Device, shape: StepShape, num_steps: int) -> None:
    """Launch `num_steps` steps of the workload on `dev` and synchronise.

    Each request appends one block per step (a ring over its blocks) and reads the others; the
    store of step k copies the blocks it wrote; the host processes step k-1 while k runs.
    """
    bpr, num_ctx = shape.blocks_per_req, shape.num_reqs * shape.blocks_per_req
    ring = 3 * shape.num_loads  # load targets rotate past the forwards that may still read them
    reqs = tuple(f"r{i}" for i in range(shape.num_reqs))
    # Block lists per ring phase, built once: the runner's own bookkeeping is not timed here.
    written_at = [[r * bpr + p for r in range(shape.num_reqs)] for p in range(bpr)]
    context_at = [[b for b in range(num_ctx) if b % bpr != p] for p in range(bpr)]
    # A fixed ring of events, re-recorded every step (two per kind: async depth 2).
    load_done = dev.new_event()
    compute_done, step_done, store_done = ([dev.new_event(), dev.new_event()] for _ in range(3))
    for k in range(num_steps):
        base = num_ctx + (k * shape.num_loads) % ring
        loaded = list(range(base, base + shape.num_loads))
        if k >= 1:
            dev.wait(LOAD, compute_done[(k - 1) % 2])
        for i, block in enumerate(loaded):
            load = AccessSet.of(reads={"host": [i]}, writes={"device": [block]})
            dev.launch(LOAD, _noop, load, OpMeta("load", k, reqs[:1]), Work.copy(1 << 16))
        dev.wait(COMPUTE, dev.record(LOAD, load_done))
        written = written_at[k % bpr]
        reads = context_at[k % bpr] + loaded
        fwd = AccessSet.of(
            reads={"device": reads}, writes={"device": written, "sampled_tokens": None}
        )
        work = Work.forward(shape.num_reqs, shape.num_layers)
        dev.launch(COMPUTE, _noop, fwd, OpMeta("forward", k, reqs), work)
        dev.wait(STORE, dev.record(COMPUTE, compute_done[k % 2]))
        for i, block in enumerate(written[: shape.num_stores]):
            host = [shape.num_loads + (k * shape.num_stores + i) % 16]
            store = AccessSet.of(reads={"device": [block]}, writes={"host": host})
            dev.launch(STORE, _noop, store, OpMeta("store", k, reqs[i : i + 1]), Work.copy(1 << 16))
        dev.record(STORE, store_done[k % 2])
        out = f"sampled_host{k % 2}"
        copy = AccessSet.of(reads={"sampled_tokens": None}, writes={out: None})
        dev.launch(COMPUTE, _noop, copy, OpMeta("sampled-copy", k, reqs))
        dev.record(COMPUTE, step_done[k % 2])
        if k >= 1:  # async depth 2: process step k-1 while step k runs
            dev.synchronize_event(step_done[(k - 1) % 2])
            dev.synchronize_event(store_done[(k - 1) % 2])
            prev = AccessSet.of(reads={f"sampled_host{(k - 1) % 2}": None})
            dev.host_op(_noop, prev, OpMeta("update", k - 1, reqs))
    dev.synchronize()


def make_bench_device(
    backend: Backend, sanitize: SanitizerMode | None, seed: int, layout: KVLayout, shape: StepShape
) -> Device:
    num_device = shape.num_reqs * shape.blocks_per_req + 3 * shape.num_loads
    dev = make_device(backend, layout, num_device, 32, sanitize=sanitize, seed=seed)
    dev.alloc_buffer("sampled_tokens", [shape.num_reqs], dtype="int64")
    for i in range(2):
        dev.alloc_buffer(f"sampled_host{i}", [shape.num_reqs], dtype="int64", tier="host")
    return dev


def tiny_step_seconds(layout: KVLayout, shape: StepShape, repeats: int = 200) -> float:
    """Best wall time of a stand-in tiny decode step: per layer QKV, a paged KV gather,
    attention over every request's blocks, output projection and an MLP (float32, CPU)."""
    gen = torch.Generator().manual_seed(0)
    heads, dim = layout.num_kv_heads, layout.head_dim
    hidden = heads * dim
    num_blocks = shape.num_reqs * shape.blocks_per_req
    kv = [
        torch.randn(layout.slot_shape(num_blocks), generator=gen) for _ in range(shape.num_layers)
    ]
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]
    w = [
        [torch.randn(*rows_cols, generator=gen) / rows_cols[0] ** 0.5 for rows_cols in shapes]
        for _ in range(shape.num_layers)
    ]
    table = torch.arange(num_blocks).view(shape.num_reqs, shape.blocks_per_req)
    x0 = torch.randn(shape.num_reqs, hidden, generator=gen)

    def step() -> torch.Tensor:
        x = x0
        for layer in range(shape.num_layers):
            wqkv, wo, w1, w2 = w[layer]
            q = (x @ wqkv)[:, :hidden].view(shape.num_reqs, heads, 1, dim)
            blocks = kv[layer][table]  # [reqs, blocks, 2, block_size, heads, dim]
            k, v = (
                blocks[:, :, i].reshape(shape.num_reqs, -1, heads, dim).transpose(1, 2)
                for i in (0, 1)
            )
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + att.reshape(shape.num_reqs, hidden) @ wo
            x = x + torch.relu(x @ w1) @ w2
        return x

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny step gains nothing from threads and suffers from contention
    try:
        step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(num_threads)
    return min(times)


CONFIGS: list[tuple[Backend, SanitizerMode | None]] = [
    (backend, sanitize) for backend in ("sim", "cpu") for sanitize in (None, "collect")
]


def time_configs(
    args: argparse.Namespace, layout: KVLayout, shape: StepShape
) -> list[dict[str, Any]]:
    """Best wall time of `args.steps` steps per configuration over `args.repeats` interleaved
    rounds (interleaving and best-of keep load from other processes out of the comparison)."""
    best = dict.fromkeys(CONFIGS, float("inf"))
    seen: dict[tuple[Backend, SanitizerMode | None], tuple[int, int]] = {}
    for _ in range(args.repeats):
        for backend, sanitize in CONFIGS:
            dev = make_bench_device(backend, sanitize, args.seed, layout, shape)
            gc.collect()
            t0 = time.perf_counter()
            run_steps(dev, shape, args.steps)
            best[backend, sanitize] = min(best[backend, sanitize], time.perf_counter() - t0)
            seen[backend, sanitize] = (dev.num_ops, len(dev.hazards))
    return [
        {
            "backend": backend,
            "sanitizer": sanitize or "off",
            "steps": args.steps,
            "ops": seen[backend, sanitize][0],
            "wall_s": best[backend, sanitize],
            "ops_per_s": seen[backend, sanitize][0] / best[backend, sanitize],
            "us_per_step": 1e6 * best[backend, sanitize] / args.steps,
            "hazards": seen[backend, sanitize][1],
        }
        for backend, sanitize in CONFIGS
    ]


class _CallLog:
    """Stands in for a device's sanitizer and records every call, to replay into a real one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *call_args: self.calls.append((name, call_args))


def sanitizer_seconds(args: argparse.Namespace, layout: KVLayout, shape: StepShape) -> float:
    """Best time to replay one run's sanitizer calls into a fresh `Sanitizer`: its pure cost."""
    dev = make_bench_device("cpu", None, args.seed, layout, shape)
    log = _CallLog()
    dev.sanitizer = log  # type: ignore[assignment]
    run_steps(dev, shape, args.steps)
    best = float("inf")
    for _ in range(args.repeats):
        san = Sanitizer("collect")
        for sid, name in DEFAULT_STREAMS.items():
            san.add_stream(sid, name)
        gc.collect()
        t0 = time.perf_counter()
        for name, call_args in log.calls:
            getattr(san, name)(*call_args)
        best = min(best, time.perf_counter() - t0)
        assert san.num_hazards == 0
    return best


def run(args: argparse.Namespace) -> int:
    if args.steps < 2 or args.repeats < 1:
        raise ValueError("--steps must be >= 2 and --repeats >= 1")
    shape = StepShape(num_reqs=args.num_reqs, blocks_per_req=args.blocks_per_req)
    layout = KVLayout(num_layer_slots=shape.num_layers, block_size=16, num_kv_heads=4, head_dim=16)
    gc.collect()
    gc.freeze()  # torch's ~10^5 long-lived objects would otherwise make full GCs timing noise
    runs = time_configs(args, layout, shape)
    sanitizer_us = 1e6 * sanitizer_seconds(args, layout, shape) / args.steps
    gc.unfreeze()
    tiny_us = 1e6 * tiny_step_seconds(layout, shape)
    device_us = {r["backend"]: r["us_per_step"] for r in runs if r["sanitizer"] == "collect"}
    overhead = {
        "sanitizer_us_per_step": sanitizer_us,
        "sanitizer_pct_of_tiny_step": 100 * sanitizer_us / tiny_us,
        **{f"{b}_device_layer_pct_of_tiny_step": 100 * us / tiny_us for b, us in device_us.items()},
    }
    result = {"shape": vars(shape), "tiny_step_us": tiny_us, "runs": runs, "overhead": overhead}
    print(f"{'backend':8} {'sanitizer':9} {'ops/s':>10} {'us/step':>9} {'hazards':>7}")
    for r in runs:
        print(
            f"{r['backend']:8} {r['sanitizer']:9} {r['ops_per_s']:10.0f} "
            f"{r['us_per_step']:9.1f} {r['hazards']:7d}"
        )
    print(f"stand-in tiny-model decode step (best): {tiny_us:.1f} us")
    print(
        f"sanitizer alone: {sanitizer_us:.1f} us/step = "
        f"{overhead['sanitizer_pct_of_tiny_step']:.1f}% of a tiny step"
    )
    for backend, us in device_us.items():
        print(
            f"{backend} device layer with sanitizer: {us:.1f} us/step = "
            f"{100 * us / tiny_us:.1f}% of a tiny step"
        )
    print(f"saved {save_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
