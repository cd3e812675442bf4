"""Garble benchmark: the public garble reproduction's table (architecture.md §History) on the sim
device — async scheduling, sliding-window layers and heavy offload, with each block-lifetime
protection switched on alone, in pairs, all, or none.

Three scenarios, each aimed at hazards of architecture.md §Hazards:
  offload  H1/H2: stores of blocks still being written, loads over blocks pruned from windows
           (every completion runs to max_tokens, so no request outlives its last scheduled step);
  finish   H3: completions stop at a sentence end, found only when the step is processed while
           the request's next step is already in flight — its blocks are freed under that step;
  drafts   H4: n-gram drafts; a rejection rolls the count back below window blocks the optimistic
           basis already pruned (the next step reads null KV).
A completion is garbled when its tokens differ from the same prompt's reference run (synchronous,
no offload, no drafts, same dtype; float64 by default so batch shapes cannot flip ties). The
sanitizer counts hazards instead of raising. Prints a table, saves JSON and optionally a PNG chart.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from kvtier.bench import save_json


@dataclass(frozen=True)
class Scenario:
    """Default variants (each 'none', 'all' or protections joined by '+'), what it exercises,
    and whether it runs with the host tier (the drafts scenario runs without one, prefix
    caching off: pruned blocks are then unhashed and handed out again first, architecture.md
    §Block)."""

    variants: str
    hazard: str
    offload: bool = True
    async_depth: int = 2
    device_fraction: float = 0.5  # of what the concurrency needs at max length
    drafts: bool = False  # n-gram drafts (--num-speculative-tokens per step)
    # NaN-poison blocks when they are handed out (architecture.md §Poison): a block
    # read after it was reused then always corrupts the reader, whichever slots the new owner
    # writes (H4 reads the tail of a block a decode step reuses from its head)
    poison: bool = False


SCENARIOS = {
    "offload": Scenario(
        "none,event,quarantine,settled,all", "H1 store RAW, H2 pruned-window load WAR"
    ),
    # depth 3: a freed block's last reader is then often still queued, not running, when the
    # next load lands, so the race corrupts data and not only the sanitizer's record
    "finish": Scenario(
        "none,settled,settled+quarantine,settled+event,all",
        "H3 blocks freed at finish while the request's next step is in flight",
        async_depth=3,
        device_fraction=0.2,  # sentence-end stops use about a fifth of the max-length need
    ),
    "drafts": Scenario(
        "none,event+quarantine,settled,settled+quarantine,all",
        "H4 draft rollback below window blocks pruned on the optimistic count",
        offload=False,
        drafts=True,
        poison=True,
    ),
}
STOP_TOKENS = (".", "\n")  # the finish scenario's sentence ends


def protect_of(variant: str) -> str:
    """'settled+quarantine' -> 'settled,quarantine'; 'all' -> every protection."""
    return "event,settled,quarantine" if variant == "all" else variant.replace("+", ",")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64, help="max_num_seqs")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=24)
    parser.add_argument("--max-prompt", type=int, default=96)
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="offload")
    parser.add_argument(
        "--device",
        choices=["sim", "cpu", "cuda"],
        default="sim",
        help="sim: modelled time, races replayed deterministically; cpu, cuda: streams are "
        "threads (and CUDA streams), races are physical and vary run to run",
    )
    parser.add_argument(
        "--async-depth",
        type=int,
        default=None,
        help="unprocessed steps at once (default: the scenario's, 2; 3 for finish)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated; each 'none', 'all' or protections joined by '+' "
        "(default: the scenario's set)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="n-gram drafts (drafts scenario)"
    )
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=None,
        help="device pool as a fraction of what the concurrency needs at max length "
        "(default: the scenario's, 0.5; 0.2 for finish)",
    )
    parser.add_argument("--host-blocks", type=int, default=20000)
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="prefix caching on in a scenario without a host tier (drafts): a hybrid's state "
        "groups then keep a page per block, which pruning can free",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_garble.json")
    parser.add_argument("--plot", default=None, help="write a PNG chart here")


def prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """Passages of Python's documentation topics (what the embedded model was trained on)."""
    import pydoc_data.topics

    rng = random.Random(args.seed)
    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_prompt, args.max_prompt)
        start = rng.randrange(0, len(ids) - n)
        out.append(ids[start : start + n])
    return out


def sampling_params(args: argparse.Namespace, tokenizer: Any) -> Any:
    """Temperature 0; every completion runs to max_tokens except in the finish scenario."""
    from kvtier.engine import SamplingParams

    if args.scenario != "finish":
        return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    stops = sorted({t for s in STOP_TOKENS for t in tokenizer.encode(s, add_special_tokens=False)})
    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=stops)


def run_variant(
    args: argparse.Namespace, batch: list[dict[str, Any]], params: Any, **kw: Any
) -> dict[str, Any]:
    from kvtier.engine import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        **kw,
    )
    engine = llm.engine
    usage: list[float] = []
    waiting: list[int] = []

    def generate(rnd: int) -> list[list[int]]:
        """One round through the engine's public surface, sampling the device pool and the
        waiting queue after every step."""
        req_ids = [f"round{rnd}-{i}" for i in range(len(batch))]
        for req_id, prompt in zip(req_ids, batch, strict=True):
            engine.add_request(req_id, prompt["prompt_token_ids"], params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.result is not None:
                    done[out.req_id] = out.result.token_ids
            stats = engine.stats()
            usage.append(stats.device.usage)
            waiting.append(stats.num_waiting + stats.num_loading)
        return [done[req_id] for req_id in req_ids]

    t0 = time.perf_counter()
    rounds = [generate(rnd) for rnd in range(args.rounds)]
    wall = time.perf_counter() - t0
    stats = engine.stats()
    m = stats.host_metrics
    device_ns = stats.device_time_ns or 0
    tokens = sum(len(t) for r in rounds for t in r)
    return {
        "rounds": rounds,
        "wall_s": wall,
        "device_s": device_ns / 1e9,
        "tokens": tokens,
        "tok_s_wall": tokens / wall,
        "tok_s_device": tokens / (device_ns / 1e9) if device_ns else None,
        "mean_kv_usage": sum(usage) / max(1, len(usage)),
        "mean_waiting": sum(waiting) / max(1, len(waiting)),
        "host_hit_rate": (m.num_hit_tokens / m.num_query_tokens)
        if m is not None and m.num_query_tokens
        else 0.0,
        "preemptions": stats.num_preemptions,
        "hazards": stats.num_hazards,
        "hazard_kinds": stats.hazards,
        **state_hazards(engine),
    }


def state_hazards(engine: Any) -> dict[str, Any]:
    """Of the hazards the sanitizer kept (its first `max_kept`), how many a state group causes:
    the earlier access (the op racing ahead of the block's reuse) is to a block its step declared
    as a state (Mamba) page (`ModelRunner.state_pages`), not a window or full-attention block
    that was later handed to a state group."""
    sanitizer = engine.device.sanitizer
    kept = [] if sanitizer is None else sanitizer.hazards
    runner = engine.runner

    def on_state(hazard: Any) -> bool:
        step = hazard.first.meta.step_seq
        pages = runner.state_pages(step) if step is not None else frozenset()
        return any(b in pages for b in hazard.block_ids)

    return {"hazards_kept": len(kept), "state_hazards": sum(map(on_state, kept))}


def parse_protect_checked(variant: str) -> tuple[str, ...]:
    from kvtier.config import PROTECTIONS, parse_protect

    names = parse_protect(protect_of(variant))
    bad = [n for n in names if n not in PROTECTIONS]
    if bad:
        raise ValueError(
            f"--variants {variant!r}: unknown protection {bad[0]!r}; use 'none', 'all' or "
            f"{'+'.join(PROTECTIONS)} joined by '+'"
        )
    return names


def run(args: argparse.Namespace) -> int:
    from kvtier.config import CacheConfig, SchedulerConfig
    from kvtier.engine.params import DEFAULT_MODEL
    from kvtier.kv.plan import plan_kv
    from kvtier.model import load_tokenizer
    from kvtier.model.hf_config import load_model_config

    path = args.model or str(DEFAULT_MODEL)
    args.model = path
    cfg = load_model_config(path)
    if "sliding" not in cfg.layer_kinds:
        raise ValueError(f"{path}: the garble benchmark needs a model with sliding-window layers")
    scenario = SCENARIOS[args.scenario]
    hybrid = cfg.mamba is not None  # state groups beside the window groups: attribute hazards
    caching = scenario.offload or args.prefix_caching
    tokenizer = load_tokenizer(path)
    batch = [{"prompt_token_ids": p} for p in prompts(tokenizer, args)]
    params = sampling_params(args, tokenizer)
    variants = (args.variants or scenario.variants).split(",")
    for v in variants:  # fail before the long reference run
        parse_protect_checked(v)
    max_len = args.max_prompt + args.max_tokens + args.block_size
    sched = SchedulerConfig(
        max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens
    )
    probe = plan_kv(cfg, CacheConfig(block_size=args.block_size, num_device_blocks=1 << 20), sched)
    needed = probe.blocks_per_request(max_len) * args.concurrency
    fraction = args.device_fraction or scenario.device_fraction
    device_blocks = max(probe.blocks_per_request(max_len) + 2, int(needed * fraction))
    print(
        f"scenario {args.scenario} ({scenario.hazard}): "
        f"{len(batch)} prompts × {args.rounds} rounds, concurrency {args.concurrency}, "
        f"{args.max_tokens} new tokens, {args.dtype}; device pool {device_blocks} blocks "
        f"(the concurrency needs {needed}), "
        + (f"host {args.host_blocks} blocks" if scenario.offload else "no host tier")
        + ("" if caching else ", no caching")
        + (", blocks NaN-poisoned when handed out" if scenario.poison else "")
    )
    ref = run_variant(  # on the variants' hardware: kernels differ between CPU and GPU
        args,
        batch,
        params,
        device="cuda" if args.device == "cuda" else "cpu",
        async_scheduling=False,
        max_model_len=max_len,
        num_device_blocks=needed + 1,
        max_num_seqs=args.concurrency,
        enable_prefix_caching=False,
    )
    reference = ref["rounds"][0]
    rows = []
    drafts = args.num_speculative_tokens if scenario.drafts else 0
    depth = args.async_depth or scenario.async_depth
    host = {"num_host_blocks": args.host_blocks} if scenario.offload else {}
    for name in variants:
        r = run_variant(
            args,
            batch,
            params,
            device=args.device,
            sanitize="collect",
            async_depth=depth,
            max_model_len=max_len,
            num_device_blocks=device_blocks,
            enable_prefix_caching=caching,
            **host,
            max_num_seqs=args.concurrency,
            protect=protect_of(name),
            num_speculative_tokens=drafts,
            poison=scenario.poison,
        )
        garbled = sum(t != reference[i] for rnd in r.pop("rounds") for i, t in enumerate(rnd))
        total = len(batch) * args.rounds
        row = {
            "variant": name,
            "garbled": garbled,
            "total": total,
            "garble_rate": garbled / total,
            **r,
        }
        rows.append(row)
        print(
            f"{name:19s} garbled {garbled:4d}/{total} ({garbled / total:6.2%})  wall {r['wall_s']:6.1f}s  "
            f"device {r['device_s']:7.2f}s  tok/s {r['tok_s_wall']:7.1f} (device "
            f"{(r['tok_s_device'] or 0):8.1f})  KV {r['mean_kv_usage']:.2f}  waiting "
            f"{r['mean_waiting']:5.1f}  host hits {r['host_hit_rate']:.2%}  preempt "
            f"{r['preemptions']:3d}  hazards {r['hazards']} {r['hazard_kinds']}"
            + (f" on state pages {r['state_hazards']}/{r['hazards_kept']}" if hybrid else ""),
            flush=True,
        )
    result = {
        "config": {k: v for k, v in vars(args).items()},
        "device_blocks": device_blocks,
        "reference": {k: v for k, v in ref.items() if k != "rounds"},
        "rows": rows,
    }
    print(f"saved {save_json(result, args.out)}")
    if args.plot:
        title = chart_title(args.scenario, args.device, depth, scenario.offload, drafts)
        _plot(rows, args.plot, title)
    return 0


def chart_title(scenario: str, device: str, depth: int, offload: bool, drafts: int) -> str:
    """The chart's title: the scenario and the settings it ran with."""
    parts = [device, f"async depth {depth}"]
    parts += ["host tier"] if offload else []
    parts += [f"{drafts} n-gram drafts"] if drafts else []
    return f"kvtier garble benchmark, scenario {scenario} ({', '.join(parts)})"


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["variant"] for r in rows]
    a.bar(names, [100 * r["garble_rate"] for r in rows], color="tab:red")
    a.tick_params(axis="x", labelrotation=30)
    b.tick_params(axis="x", labelrotation=30)
    a.set_ylabel("garbled completions (%)")
    b.bar(names, [r["hazards"] for r in rows], color="tab:blue")
    b.set_ylabel("sanitizer hazards")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
