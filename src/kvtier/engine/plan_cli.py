"""`kvtier plan`: print (and optionally save) the KV byte plan of a model configuration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.cli_args import add_dataclass_args, dataclass_from_args
from kvtier.config import CacheConfig, ModelConfig, SchedulerConfig
from kvtier.kv.plan import GIB, KVPlan, plan_kv
from kvtier.model.hf_config import load_model_config

DEFAULT_MODEL = "gemma-3-1b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local HF model folder, config.json, or bundled preset (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--json", dest="json_out", default=None, help="also save the plan as JSON here"
    )
    add_dataclass_args(parser, CacheConfig)
    add_dataclass_args(parser, SchedulerConfig)


def plan_summary(model: ModelConfig, plan: KVPlan) -> dict[str, Any]:
    groups = [
        {
            "spec": repr(g.spec),
            "layers": list(g.layer_indices),
            "page_bytes": plan.group_page_bytes(g),
        }
        for g in plan.groups
    ]
    tiers = [
        {
            "tier": t.name,
            "blocks": t.num_blocks,
            "bytes_per_block": t.bytes_per_block,
            "total_bytes": t.total_bytes,
            "max_concurrency_at_max_len": plan.max_concurrency(t.name),
        }
        for t in plan.tiers
    ]
    return {
        "model": model.source,
        "architecture": model.architecture,
        "block_size": plan.block_size,
        "requested_block_size": plan.requested_block_size,
        "max_model_len": plan.max_model_len,
        "max_in_flight_tokens": plan.max_in_flight_tokens,
        "admission": plan.admission.name,
        "layers_per_group": plan.layers_per_group,
        "page_bytes": plan.page_bytes,
        "attention_page_bytes": plan.attention_page_bytes,
        "state_page_bytes": plan.state_page_bytes,
        "padding_fraction": plan.padding_fraction,
        "blocks_per_max_len_request": plan.blocks_per_request(plan.max_model_len),
        "groups": groups,
        "tiers": tiers,
    }


def run(args: argparse.Namespace) -> int:
    model = load_model_config(args.model)
    cache = dataclass_from_args(CacheConfig, args)
    sched = dataclass_from_args(SchedulerConfig, args)
    if cache.num_device_blocks is None and cache.kv_cache_memory_bytes is None:
        cache = CacheConfig(**{**cache.__dict__, "kv_cache_memory_bytes": 4 * GIB})
    plan = plan_kv(model, cache, sched)
    s = plan_summary(model, plan)
    print(f"model {s['model']} ({s['architecture']}), {len(model.layer_kinds)} layers")
    print(
        f"block size {plan.block_size} tokens, {plan.layers_per_group} layer slots per block, "
        f"{plan.page_bytes} B per layer page, {plan.bytes_per_block} B per block "
        f"(slot padding {plan.padding_fraction:.1%})"
    )
    if plan.state_page_bytes:
        _print_state(model, plan, cache.enable_prefix_caching)
    for g in plan.groups:
        print(f"  group {g.spec!r}: layers {list(g.layer_indices)}")
    print(
        f"max_model_len {plan.max_model_len}, max in-flight tokens {plan.max_in_flight_tokens} "
        f"(async depth × --max-num-batched-tokens)"
    )
    print(
        f"one max-length request needs {s['blocks_per_max_len_request']} blocks (reserve included; "
        f"--admission {plan.admission.name})"
    )
    for t in s["tiers"]:
        print(
            f"tier {t['tier']:6s}: {t['blocks']} blocks × {t['bytes_per_block']} B "
            f"= {t['total_bytes'] / GIB:.3f} GiB (ids shared by {len(plan.groups)} groups); "
            f"max concurrency at max length: {t['max_concurrency_at_max_len']}"
        )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(s, indent=2) + "\n")
        print(f"saved {args.json_out}")
    return 0


def _print_state(model: ModelConfig, plan: KVPlan, caching: bool) -> None:
    shape = model.mamba
    assert shape is not None
    print(
        f"Mamba state page: conv {shape.conv_dim}×{shape.conv_kernel - 1} + SSM "
        f"{shape.num_heads}×{shape.head_dim}×{shape.state_size} elements in {model.dtype} = "
        f"{plan.state_page_bytes} B per Mamba layer; "
        + (
            f"a state group holds one live page per request (prefix caching keeps snapshots at "
            f"{plan.block_size}-token boundaries a step ends on)"
            if caching
            else "without prefix caching a state group holds one page per request for its whole "
            "life, updated in place"
        )
    )
    if plan.block_size != plan.requested_block_size:
        print(
            f"block size raised from --block-size {plan.requested_block_size} to "
            f"{plan.block_size} tokens so an attention page ({plan.attention_page_bytes} B) holds "
            f"a state page; a larger --block-size that already does is kept"
        )
