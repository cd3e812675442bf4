"""How an engine's arguments become its KV plan: the defaults the plan's one sizing formula
(`kv.plan.plan_kv`, architecture.md §Admission) is given — the KV dtype resolved from `auto`, a
max_model_len from the model, a device budget when none is given — and the runner's draft pages
paid from the same budget."""

from __future__ import annotations

import logging
from dataclasses import replace

from kvtier.config import FP8_KV_DTYPES, CacheConfig, ModelConfig, SchedulerConfig
from kvtier.engine.params import EngineArgs
from kvtier.kv.plan import KVPlan, plan_kv
from kvtier.model.served import ServedModel
from kvtier.runner.draft_states import DraftStates

log = logging.getLogger("kvtier.engine")
DEFAULT_KV_BYTES = 1 << 30  # device KV budget when neither blocks nor bytes are given (as vLLM CPU)


def plan_engine(
    args: EngineArgs, cfg: ModelConfig, model: ServedModel, dtype_name: str
) -> tuple[EngineArgs, KVPlan]:
    """`args` with the cache and scheduler settings the plan was made from (defaults resolved),
    and the plan. `dtype_name`: the dtype the model runs in."""
    cache = args.cache
    # The pool is allocated in the dtype the plan sizes (architecture.md §Pages): resolve
    # auto here, once, and build the device layout from the same value.
    cache = replace(cache, kv_cache_dtype=cache.kv_dtype(dtype_name))
    if cfg.mamba is not None:  # states: the run's dtype in the pages' bytes, whatever K/V's
        cfg = replace(cfg, dtype=dtype_name)
    unscaled = all(s == (1.0, 1.0) for s in model.kv_scales())
    if cache.kv_cache_dtype == FP8_KV_DTYPES["fp8"] and unscaled:  # as vLLM: e4m3 only
        log.warning(
            "--kv-cache-dtype %s with k/v scales 1.0: %s carries no k_scale/v_scale "
            "tensors (an fp8-calibrated compressed-tensors or ModelOpt checkpoint does), "
            "so K/V beyond ±448 saturate",
            args.cache.kv_cache_dtype,
            args.model_path,
        )
    sched = args.scheduler
    if sched.max_model_len is None:
        sched = replace(sched, max_model_len=cfg.max_position_embeddings)
    num_draft_pages = DraftStates.num_pages(
        len(model.state_groups), args.num_speculative_tokens, sched.max_num_seqs
    )
    if cache.num_device_blocks is None and cache.kv_cache_memory_bytes is None:
        # No budget given: 1 GiB, but never more blocks than max_num_seqs max-length
        # requests can use (small models would otherwise carry millions of idle blocks).
        default = without_draft_pages(cfg, cache, sched, DEFAULT_KV_BYTES, num_draft_pages)
        plan = plan_kv(cfg, default, sched)
        wanted = plan.blocks_for_requests(sched.max_num_seqs, plan.max_model_len)
        cache = replace(cache, num_device_blocks=min(plan.tiers[0].num_blocks, wanted + 1))
    elif cache.num_device_blocks is None and cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        cache = without_draft_pages(cfg, cache, sched, budget, num_draft_pages)
    return replace(args, cache=cache, scheduler=sched), plan_kv(cfg, cache, sched)


def without_draft_pages(
    cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, budget: int, num_pages: int
) -> CacheConfig:
    """`cache` with a byte budget of `budget` less `num_pages` draft pages (a hybrid with drafts,
    runner/draft_states.py): they come out of the same memory as the KV blocks."""
    if num_pages:
        probe = replace(cache, kv_cache_memory_bytes=None, num_device_blocks=1 << 20)
        pages = num_pages * plan_kv(cfg, probe, sched).bytes_per_block
        if pages >= budget:
            raise ValueError(
                f"the {num_pages} draft pages for {sched.max_num_seqs} sequences (a hybrid with "
                f"--num-speculative-tokens) take {pages} bytes of the KV budget ({budget}); "
                "raise --kv-cache-memory-bytes or lower --max-num-seqs or "
                "--num-speculative-tokens"
            )
        budget -= pages
    return replace(cache, kv_cache_memory_bytes=budget)
