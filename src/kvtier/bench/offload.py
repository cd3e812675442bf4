"""Offload benchmark: does the host-memory KV tier pay? A multi-round shared-prefix workload
whose working set exceeds the device pool, run with the host tier off and on (same engine, same
workload, sim device), measured in modelled device time and wall time.

Workload (`kvtier.bench.serve_data`'s shared-prefix conversations, as token ids): --num-prefixes
system prompts of --prefix-len tokens, --users-per-prefix conversations on each, --rounds rounds;
a round's prompt is the previous prompt + its answer + a new question of --question-len tokens,
answers are --answer-len greedy tokens (ignore EOS). A closed loop keeps --concurrency requests in
flight: a conversation's next round joins the back of the queue when its answer is complete, so
every conversation is revisited only after all the others (reuse distance ≈ the working set).

The working set is the KV every conversation's next round needs to hit its whole history (the
full-attention blocks of each prefix once plus each conversation's own, and each window group's
blocks at the history's end); the device pool is --device-fraction of it (never less than the
concurrency needs), the host tier holds every block of every conversation in every group. The
tier runs once per --store-modes entry (eager, lazy); --copy-gbps sets the sim's copy bandwidth.

Per configuration: TTFT (mean / median / p99) and output tokens/s on the modelled device clock
and on the wall clock, prompt tokens served by device hits / host hits / recompute, host loads and
stores, preemptions, sanitizer hazards; the on/off ratios; and whether every completion has the
same tokens as with the tier off (greedy). Prints a table, saves JSON, optionally a PNG.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench import save_json
from kvtier.bench.offload_report import percentiles, plot, print_row, ratio
from kvtier.bench.offload_tiers import (
    add_tier_arguments,
    parse_tiers,
    tier_configurations,
    tier_hits,
    tier_io,
)
from kvtier.bench.offload_workload import Workload, build_workload, drive, working_set_blocks

if TYPE_CHECKING:
    from kvtier.device.costs import CostModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared system prompts")
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each prefix")
    parser.add_argument("--users-per-prefix", type=int, default=8, help="conversations each")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each conversation")
    parser.add_argument("--question-len", type=int, default=64, help="new tokens per round")
    parser.add_argument("--answer-len", type=int, default=64, help="greedy tokens per answer")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="question/answer lengths vary ± this"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=0.5,
        help="device pool as a fraction of the working set (floor: what the concurrency needs)",
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help="host tier blocks (default: every block of every conversation in every group)",
    )
    parser.add_argument(
        "--store-modes",
        default="eager,lazy",
        help="host-tier store modes to run with the tier on, comma-separated",
    )
    parser.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help="host<->device copy bandwidth of the sim cost model in GB/s (default: the sim's); "
        "lower it to see how slow copies may get before the tier stops paying",
    )
    parser.add_argument(
        "--device",
        choices=("sim", "cpu"),
        default="sim",
        help="sim: modelled device time (and wall); cpu: wall time only",
    )
    add_tier_arguments(parser)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (the wall clock only; tiny models lose with more)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_offload.json")
    parser.add_argument("--plot", default=None, help="write a PNG chart here")


# ---- workload ------------------------------------------------------------------------------------


# ---- one configuration --------------------------------------------------------------------------


def run_config(
    args: argparse.Namespace, w: Workload, engine_kw: dict[str, Any]
) -> tuple[dict[str, Any], dict[tuple[int, int], list[int]]]:
    from kvtier.device.sim import SimDevice
    from kvtier.engine import LLM

    llm = LLM(args.model, torch_threads=args.torch_threads, **engine_kw)
    engine = llm.engine
    device = engine.device
    if isinstance(device, SimDevice):
        device.cost_model = cost_model(args)
    t0_ns, t0_wall = getattr(device, "now_ns", 0), time.perf_counter()
    try:
        records = drive(engine, w, args.concurrency)
        stats = engine.stats()
        lower = tier_hits(engine, sum(r.host_tokens for r in records))
        io = tier_io(engine)
    finally:
        engine.close()  # the disk and remote tiers finish their writes; the folder is unlocked
    # The measured span ends with the last answer (stores still in flight are not counted).
    end_ns = max(r.done_ns or 0 for r in records)
    wall = max(r.done_wall or 0.0 for r in records) - t0_wall
    device_s = (end_ns - t0_ns) / 1e9 if isinstance(device, SimDevice) else 0.0
    out_tokens = sum(len(r.output or []) for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records)
    external = sum(r.host_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    m = stats.host_metrics
    hits = {"device": cached - external, **lower, "recompute": prompt_tokens - cached}
    if not io:  # host off vs on: no lower tiers to name
        hits = {k: v for k, v in hits.items() if k not in ("disk", "remote")}
    ttft_dev = {id(r): r.ttft_device_ms for r in records}
    by_round = []
    for rnd in range(w.rounds):
        rs = [r for r in records if r.round == rnd]
        p = sum(r.prompt_tokens for r in rs)
        by_round.append(
            {
                "round": rnd,
                "requests": len(rs),
                "ttft_device_ms_mean": sum(ttft_dev[id(r)] for r in rs) / max(1, len(rs)),
                "device_hit": sum(r.cached_tokens - r.host_tokens for r in rs) / max(1, p),
                "host_hit": sum(r.host_tokens for r in rs) / max(1, p),
            }
        )
    row = {
        "requests": len(records),
        "device_blocks": engine.plan.tiers[0].num_blocks,
        "host_blocks": next((t.num_blocks for t in engine.plan.tiers if t.name == "host"), 0),
        "device_s": device_s,
        "wall_s": wall,
        "ttft_device_ms": percentiles(list(ttft_dev.values())),
        "ttft_wall_ms": percentiles([r.ttft_wall_ms for r in records]),
        "output_tokens": out_tokens,
        "tok_s_device": out_tokens / device_s if device_s else None,
        "tok_s_wall": out_tokens / wall,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hits,
        "hit_fraction": {k: v / prompt_tokens for k, v in hits.items()},
        "lower_tiers": io,
        "host_loads": {
            "blocks": m.num_loaded_blocks if m else 0,
            "bytes": m.num_loaded_bytes if m else 0,
            "failed": m.num_failed_loads if m else 0,
        },
        "host_stores": {
            "blocks": m.num_stored_blocks if m else 0,
            "bytes": m.num_stored_bytes if m else 0,
            "evicted": m.num_evicted_blocks if m else 0,
        },
        "preemptions": stats.num_preemptions,
        "hazards": stats.num_hazards,
        "by_round": by_round,
    }
    tokens = {(r.conv, r.round): r.output or [] for r in records}
    return row, tokens


# ---- the benchmark ------------------------------------------------------------------------------


def store_modes(args: argparse.Namespace) -> list[str]:
    from kvtier.config import STORE_MODES

    modes = [m.strip() for m in args.store_modes.split(",") if m.strip()]
    bad = sorted(set(modes) - set(STORE_MODES))
    if bad or not modes:
        raise SystemExit(f"--store-modes: choose from {', '.join(STORE_MODES)}, got {bad or modes}")
    return modes


def configurations(modes: list[str], host_blocks: int) -> list[tuple[str, dict[str, Any]]]:
    """[(name, engine keywords beyond the common ones)]: off, then on per store mode."""
    configs: list[tuple[str, dict[str, Any]]] = [("off", {})]
    for mode in modes:
        kw = {"num_host_blocks": host_blocks, "kv_offload_store_mode": mode}
        configs.append((f"on-{mode}", kw))
    return configs


def cost_model(args: argparse.Namespace) -> CostModel:
    """The sim's default cost model, with --copy-gbps applied (1 GB/s = 1 byte/ns)."""
    from kvtier.device.costs import CostModel

    if args.copy_gbps is None:
        return CostModel()
    if args.copy_gbps <= 0:
        raise SystemExit("--copy-gbps must be positive")
    return replace(CostModel(), copy_bytes_per_ns=args.copy_gbps)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import CacheConfig, SchedulerConfig
    from kvtier.engine.params import DEFAULT_MODEL
    from kvtier.kv.plan import plan_kv
    from kvtier.kv.specs import blocks_for_requests
    from kvtier.model.hf_config import load_model_config

    tiers = parse_tiers(args) if args.tiers else None
    modes = store_modes(args)
    path = Path(args.model) if args.model else DEFAULT_MODEL
    cfg = load_model_config(path)
    w = build_workload(args, path)
    max_len = w.max_len + args.block_size
    sched = SchedulerConfig(
        max_model_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.concurrency,
    )
    dtype = cfg.dtype if args.dtype == "auto" else args.dtype
    cache = CacheConfig(block_size=args.block_size, num_device_blocks=1 << 20, kv_cache_dtype=dtype)
    probe = plan_kv(cfg, cache, sched)
    specs = probe.specs
    working, every = working_set_blocks(specs, w)
    floor = blocks_for_requests(specs, args.concurrency, max_len, sched.max_in_flight_tokens) + 1
    device_blocks = max(floor, int(working * args.device_fraction))
    if args.host_blocks is None:
        args.host_blocks = every
    common: dict[str, Any] = {
        "device": args.device,
        "sanitize": "collect" if args.device == "sim" else None,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_model_len": max_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.concurrency,
        "num_device_blocks": device_blocks,
        "seed": args.seed,
    }
    cost = cost_model(args)
    # What one token costs to recompute (forward, all layers) vs to load (its blocks in every
    # group: an upper bound, window groups load only their window).
    recompute_ns = cost.forward_token_layer_ns * cfg.num_layers
    block_bytes = probe.bytes_per_block * len(probe.groups)
    load_ns = block_bytes / args.block_size / cost.copy_bytes_per_ns
    n_req = len(w.convs) * w.rounds
    print(
        f"bench offload: {path} ({dtype}); "
        f"{w.num_prefixes} prefixes × {args.prefix_len} tokens, {len(w.convs)} conversations × "
        f"{w.rounds} rounds (+{args.question_len} question, {args.answer_len} answer tokens), "
        f"concurrency {args.concurrency}; {n_req} requests"
    )
    print(
        f"working set {working} blocks; device pool {device_blocks} blocks "
        f"({device_blocks / working:.0%} of it; the concurrency needs {floor}); host tier "
        f"{args.host_blocks} blocks"
    )
    print(
        f"sim cost model: recompute {recompute_ns / 1e3:.2f} µs/token "
        f"({cost.forward_token_layer_ns} ns × {cfg.num_layers} layers, + "
        f"{cost.forward_layer_ns / 1e3:.0f} µs × layers per forward), load ≤ "
        f"{load_ns / 1e3:.3f} µs/token ({block_bytes} B per {args.block_size}-token block in "
        f"all {len(probe.groups)} groups at {cost.copy_bytes_per_ns:g} B/ns, + "
        f"{cost.copy_latency_ns / 1e3:.0f} µs per copy; window groups load only their window): "
        f"recomputing a token costs ≥ {recompute_ns / load_ns:.1f}× loading it",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-") as tmp:
        disk = Path(args.disk_path or tmp)
        if tiers is None:
            configs = configurations(modes, args.host_blocks)
        else:
            block_bytes = probe.bytes_per_block
            configs = tier_configurations(tiers, args, every, block_bytes, str(disk))
            print(f"tiers: {'; '.join(f'{n} {kw}' for n, kw in configs)}", flush=True)
        for name, kw in configs:
            if disk.exists():  # each configuration starts with an empty disk tier
                shutil.rmtree(disk)
            row, tokens = run_config(args, w, {**common, **kw})
            outputs[name] = tokens
            ref = outputs[configs[0][0]]
            same = sum(tokens[k] == ref[k] for k in ref)
            row = {"config": name, "same_tokens_as_off": same, **row}
            rows.append(row)
            print_row(row, len(ref))
    off = rows[0]
    ratios = {}
    for row in rows[1:]:
        ratios[row["config"]] = {
            "ttft_device_mean_off_over_on": ratio(
                off["ttft_device_ms"]["mean"], row["ttft_device_ms"]["mean"]
            ),
            "ttft_device_median_off_over_on": ratio(
                off["ttft_device_ms"]["median"], row["ttft_device_ms"]["median"]
            ),
            "ttft_device_p99_off_over_on": ratio(
                off["ttft_device_ms"]["p99"], row["ttft_device_ms"]["p99"]
            ),
            "tok_s_device_on_over_off": ratio(row["tok_s_device"], off["tok_s_device"]),
            "ttft_wall_mean_off_over_on": ratio(
                off["ttft_wall_ms"]["mean"], row["ttft_wall_ms"]["mean"]
            ),
            "tok_s_wall_on_over_off": ratio(row["tok_s_wall"], off["tok_s_wall"]),
        }
        r = {k: "n/a" if v is None else f"×{v:.2f}" for k, v in ratios[row["config"]].items()}
        print(
            f"{row['config']} vs {off['config']}: TTFT (device) mean "
            f"{r['ttft_device_mean_off_over_on']} lower, median "
            f"{r['ttft_device_median_off_over_on']}, p99 {r['ttft_device_p99_off_over_on']}; "
            f"output tok/s (device) {r['tok_s_device_on_over_off']}; wall: TTFT "
            f"{r['ttft_wall_mean_off_over_on']}, tok/s {r['tok_s_wall_on_over_off']}"
        )
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "workload": {
            "conversations": len(w.convs),
            "requests": n_req,
            "max_len": w.max_len,
            "working_set_blocks": working,
            "all_blocks": every,
            "device_blocks": device_blocks,
            "device_floor_blocks": floor,
            "host_blocks": args.host_blocks,
        },
        "cost_model": {
            "recompute_ns_per_token": recompute_ns,
            "load_ns_per_token": load_ns,
            "copy_latency_ns": cost.copy_latency_ns,
            "forward_fixed_ns": cost.forward_layer_ns * cfg.num_layers,
        },
        "rows": rows,
        "ratios": ratios,
    }
    print(f"saved {save_json(result, args.out)}")
    if args.plot:
        plot(rows, args.plot)
    return 0
