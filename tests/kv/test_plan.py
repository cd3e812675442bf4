"""The byte plan: grouping, bytes per block, budget → blocks, max concurrency, refusals."""

from __future__ import annotations

import pytest

from kvtier.config import CacheConfig, ModelConfig, SchedulerConfig
from kvtier.kv import FullAttention, KVCacheManager, SlidingWindow
from kvtier.kv.plan import GIB, group_layers, plan_kv


def gemma3() -> ModelConfig:
    return ModelConfig.from_pretrained("gemma-3-1b")


def test_gemma3_groups_full_first_with_equal_slot_counts() -> None:
    groups, slots = group_layers(gemma3(), 16)
    assert slots == 4  # four global layers: 5, 11, 17, 23
    assert groups[0].spec == FullAttention(16)
    assert groups[0].layer_indices == (5, 11, 17, 23)
    assert [len(g.layer_indices) for g in groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert all(g.spec == SlidingWindow(16, 512) for g in groups[1:])
    covered = sorted(i for g in groups for i in g.layer_indices)
    assert covered == list(range(26))


def test_bytes_per_block_from_layer_shapes_and_dtype() -> None:
    model = gemma3()  # 1 KV head × 256 dims, bfloat16
    plan = plan_kv(model, CacheConfig(num_device_blocks=4000), SchedulerConfig(max_model_len=4096))
    assert plan.page_bytes == 2 * 16 * 1 * 256 * 2
    assert plan.bytes_per_block == 4 * plan.page_bytes
    f32 = plan_kv(
        model,
        CacheConfig(num_device_blocks=4000, kv_cache_dtype="float32"),
        SchedulerConfig(max_model_len=4096),
    )
    assert f32.bytes_per_block == 2 * plan.bytes_per_block


def test_budget_in_bytes_gives_floor_blocks() -> None:
    plan = plan_kv(
        gemma3(),
        CacheConfig(kv_cache_memory_bytes=GIB + 1000),
        SchedulerConfig(max_model_len=4096),
    )
    assert plan.tiers[0].num_blocks == GIB // plan.bytes_per_block


def test_max_concurrency_matches_runtime_admission_formula() -> None:
    """Startup sizing and the manager's reported concurrency come from one function."""
    sched = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=512)
    plan = plan_kv(gemma3(), CacheConfig(num_device_blocks=3000), sched)
    mgr = KVCacheManager(
        plan.specs, 3000, max_model_len=4096, max_in_flight_tokens=sched.max_in_flight_tokens
    )
    assert plan.max_concurrency() == mgr.max_concurrency()
    n = plan.max_concurrency()
    assert plan.blocks_per_request(4096) > 0
    assert mgr.blocks_for_requests(n, 4096) <= 2999 < mgr.blocks_for_requests(n + 1, 4096)


def test_impossible_budget_names_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--max-model-len to ≤ \d+"):
        plan_kv(gemma3(), CacheConfig(num_device_blocks=2000), SchedulerConfig())
    with pytest.raises(ValueError, match=r"--max-model-len to ≤ 224\b"):
        plan_kv(gemma3(), CacheConfig(num_device_blocks=100), SchedulerConfig())
    with pytest.raises(ValueError, match="fewer than one per KV-cache group"):
        plan_kv(gemma3(), CacheConfig(num_device_blocks=5), SchedulerConfig())


def test_host_tier_from_offloading_size() -> None:
    plan = plan_kv(
        gemma3(),
        CacheConfig(num_device_blocks=5000, kv_offloading_size=1.0),
        SchedulerConfig(max_model_len=4096),
    )
    host = plan.tiers[1]
    assert host.name == "host" and host.num_blocks == GIB // plan.bytes_per_block


def test_sync_scheduling_shrinks_the_reserve() -> None:
    cache = CacheConfig(num_device_blocks=6000)
    a = plan_kv(gemma3(), cache, SchedulerConfig(max_model_len=8192))
    s = plan_kv(gemma3(), cache, SchedulerConfig(max_model_len=8192, async_scheduling=False))
    assert s.max_in_flight_tokens == a.max_in_flight_tokens // 2
    assert s.blocks_per_request(8192) < a.blocks_per_request(8192)
