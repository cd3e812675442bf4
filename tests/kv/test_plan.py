"""The byte plan: grouping, bytes per block, budget → blocks, max concurrency, refusals."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.config import CacheConfig, ModelConfig, SchedulerConfig
from kvtier.kv import FullAttention, KVCacheManager, Mamba, SlidingWindow
from kvtier.kv.plan import GIB, group_layers, plan_kv
from kvtier.kv.plan_cli import add_arguments, run


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


# ---- state (Mamba) groups ------------------------------------------------------------------------


def falcon_h1() -> ModelConfig:
    return ModelConfig.from_pretrained("falcon-h1-0.5b")


FALCON_STATE_BYTES = (1792 * 3 + 24 * 64 * 128) * 2  # conv + SSM elements, bfloat16


def test_falcon_h1_has_an_attention_group_and_a_state_group_with_raised_blocks() -> None:
    plan = plan_kv(falcon_h1(), CacheConfig(kv_cache_memory_bytes=4 * GIB), SchedulerConfig())
    assert [(g.spec, g.layer_indices) for g in plan.groups] == [
        (FullAttention(800), tuple(range(36))),
        (Mamba(800), tuple(range(36))),
    ]
    assert plan.requested_block_size == 16 and plan.block_size == 800  # 16 × cdiv(state, 8 KiB)
    assert plan.state_page_bytes == FALCON_STATE_BYTES == 403_968
    assert plan.attention_page_bytes == 2 * 800 * 2 * 64 * 2 == plan.page_bytes
    assert plan.bytes_per_block == 36 * 409_600
    assert plan.padding_fraction == pytest.approx(
        1 - (409_600 + FALCON_STATE_BYTES) / (2 * 409_600)
    )


def test_falcon_h1_max_concurrency_is_the_admission_formula() -> None:
    """4 GiB hold 291 blocks of 800 tokens; a 16K request needs cdiv(16384, 800) = 21 attention
    blocks and 1 state block, and the state group's reserve is min(cdiv(4096, 800) + R, 20 R)."""
    sched = SchedulerConfig()  # async depth 2 × 2048 tokens in flight
    plan = plan_kv(falcon_h1(), CacheConfig(kv_cache_memory_bytes=4 * GIB), sched)
    usable = plan.tiers[0].num_blocks - 1
    assert usable == 4 * GIB // (36 * 409_600) - 1 == 290
    by_hand = max(r for r in range(100) if 22 * r + min(6 + r, 20 * r) <= usable)
    assert plan.max_concurrency() == by_hand == 12
    mgr = KVCacheManager(
        plan.specs, usable + 1, max_model_len=16384, max_in_flight_tokens=sched.max_in_flight_tokens
    )
    assert mgr.max_concurrency() == plan.max_concurrency()
    assert mgr.blocks_for_requests(12, 16384) <= usable < mgr.blocks_for_requests(13, 16384)


@pytest.mark.parametrize(
    ("block_size", "kv_dtype", "expected"),
    [
        (800, None, 800),  # already holds a state page
        (1024, None, 1024),
        (16, "float32", 400),  # float32 K/V: pages twice as large; the state stays bfloat16
        (100, None, 800),  # multiples of the requested size
    ],
)
def test_a_block_size_that_holds_a_state_page_is_kept(block_size, kv_dtype, expected) -> None:
    cache = CacheConfig(block_size=block_size, kv_cache_dtype=kv_dtype, num_device_blocks=1000)
    plan = plan_kv(falcon_h1(), cache, SchedulerConfig())
    assert plan.block_size == expected and plan.state_page_bytes == FALCON_STATE_BYTES
    assert plan.attention_page_bytes >= plan.state_page_bytes


GRANITE_LIKE = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "torch_dtype": "float32",
}


def test_interleaved_hybrid_groups_by_the_fewest_layers() -> None:
    """Granite-like: one attention layer and three Mamba layers give four one-slot groups."""
    model = ModelConfig.from_hf_dict(GRANITE_LIKE)
    plan = plan_kv(model, CacheConfig(num_device_blocks=500), SchedulerConfig(max_model_len=512))
    assert [g.spec for g in plan.groups] == [FullAttention(32)] + [Mamba(32)] * 3
    assert [g.layer_indices for g in plan.groups] == [(1,), (0,), (2,), (3,)]
    state = (160 * 3 + 8 * 16 * 8) * 4  # conv (128 + 2 × 2 × 8 channels) + SSM, float32
    assert plan.state_page_bytes == state == 6016
    assert plan.block_size == 32  # a 16-token attention page (4096 B) cannot hold it; 32 can
    assert plan.attention_page_bytes == plan.page_bytes == 2 * 32 * 2 * 16 * 4
    assert plan.padding_fraction == pytest.approx(1 - (8192 + 3 * state) / (4 * 8192))


def test_plain_models_plan_as_before() -> None:
    plan = plan_kv(
        gemma3(), CacheConfig(num_device_blocks=4000), SchedulerConfig(max_model_len=4096)
    )
    assert plan.state_page_bytes == 0 and plan.page_bytes == plan.attention_page_bytes
    assert plan.block_size == plan.requested_block_size == 16


def test_plan_command_prints_the_state_page(capsys, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "plan.json"
    assert run(parser.parse_args(["--model", "falcon-h1-0.5b", "--json", str(out)])) == 0
    text = capsys.readouterr().out
    assert "Mamba state page: conv 1792×3 + SSM 24×64×128 elements in bfloat16 = 403968 B" in text
    assert "block size raised from --block-size 16 to 800 tokens" in text
    saved = json.loads(out.read_text())
    assert saved["state_page_bytes"] == FALCON_STATE_BYTES and saved["block_size"] == 800
    assert saved["tiers"][0]["max_concurrency_at_max_len"] == 12
    assert [g["page_bytes"] for g in saved["groups"]] == [409_600, FALCON_STATE_BYTES]
