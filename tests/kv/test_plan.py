"""The byte plan: grouping, bytes per block, budget → blocks, max concurrency, refusals."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.bench.fake_runner import FakeRunner
from kvtier.config import ADMISSION_POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from kvtier.engine.plan_cli import add_arguments, run
from kvtier.kv import ChunkedLocal, FullAttention, KVCacheManager, KVSpec, Mamba, SlidingWindow
from kvtier.kv.plan import GIB, group_layers, plan_kv
from kvtier.kv.specs import (
    AdmissionPolicy,
    PerRequestReserve,
    admission_policy,
    blocks_for_requests,
    max_concurrency,
)
from kvtier.model.hf_config import load_model_config, model_config_from_dict
from kvtier.sampling import StopConditions
from kvtier.sched import Request, RequestStatus, Scheduler, SchedulerOutput
from tests.sched.fake_engine import FakeEngine


def gemma3() -> ModelConfig:
    return load_model_config("gemma-3-1b")


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


def test_plan_refuses_a_chunk_the_engine_refuses() -> None:
    """`kvtier plan` printed a plan for a chunk that is no multiple of the block size, which the
    engine's coordinator then refused at startup."""
    n = gemma3().num_layers
    kinds = tuple("full" if (i + 1) % 4 == 0 else "chunked" for i in range(n))
    llama4ish = dataclasses.replace(
        gemma3(), layer_kinds=kinds, sliding_window=None, attention_chunk_size=100
    )
    with pytest.raises(ValueError, match="attention chunk 100 must be a multiple of the block"):
        plan_kv(llama4ish, CacheConfig(num_device_blocks=5000, block_size=16), SchedulerConfig())
    ok = dataclasses.replace(llama4ish, attention_chunk_size=96)
    assert plan_kv(ok, CacheConfig(num_device_blocks=5000, block_size=16), SchedulerConfig())


def test_host_tier_too_small_for_one_block_names_the_flag_and_the_minimum() -> None:
    """A --kv-offloading-size under one block's bytes used to round to a host tier of 0 blocks
    that stored nothing, silently."""
    cfg = CacheConfig(num_device_blocks=5000, kv_offloading_size=1e-9)
    with pytest.raises(ValueError, match=r"--kv-offloading-size .* at least [\d.e-]+ GiB"):
        plan_kv(gemma3(), cfg, SchedulerConfig(max_model_len=4096))


def test_sync_scheduling_shrinks_the_reserve() -> None:
    cache = CacheConfig(num_device_blocks=6000)
    a = plan_kv(gemma3(), cache, SchedulerConfig(max_model_len=8192))
    s = plan_kv(gemma3(), cache, SchedulerConfig(max_model_len=8192, async_scheduling=False))
    assert s.max_in_flight_tokens == a.max_in_flight_tokens // 2
    assert s.blocks_per_request(8192) < a.blocks_per_request(8192)


# ---- admission policies: one formula, three charges ----------------------------------------------

GEMMA4 = [FullAttention(16)] + [
    SlidingWindow(16, 1024)
] * 5  # 1 full + 5 SWA groups (architecture.md §Admission)
STEP = 8192  # the seed's max_num_batched_tokens; async depth 2 → 16,384 tokens in flight


def policy(name: str) -> AdmissionPolicy:
    return admission_policy(name, STEP)


@pytest.mark.parametrize(
    ("name", "num_tokens", "per_request"),
    [
        ("optimistic", 16384, 1024 + 5 * 577),  # vLLM before #47728: W - 1 + B
        ("per-request", 16384, 1024 + 5 * 1024),  # after: W - 1 + 2B, capped by the table
        ("optimistic", 12288, 768 + 5 * 577),
        ("per-request", 12288, 768 + 5 * 768),  # −21 % admitted at 12K (architecture.md §Admission)
        ("optimistic", 3700, 232 + 5 * 232),  # short requests: both charge their whole table
        ("per-request", 3700, 232 + 5 * 232),
        ("shared", 16384, 1024 + 5 * 65),  # steady windows only; the reserve is the pool's
    ],
)
def test_per_request_charge_of_each_policy_reproduces_the_seed_arithmetic(
    name: str, num_tokens: int, per_request: int
) -> None:
    """vLLM (architecture.md §Admission): a 16K request is charged 3,909 blocks before vLLM's fix and 6,144 after
    (≈ 36 % fewer admitted), 3,653 → 4,608 at 12K, no change below ~9.2K tokens."""
    p = policy(name)
    assert sum(p.request_blocks(s, num_tokens, 2 * STEP) for s in GEMMA4) == per_request
    pool = sum(p.pool_blocks(s, 2 * STEP, 10, num_tokens) for s in GEMMA4)
    assert pool == (5 * (1024 + 10) if name == "shared" else 0)


def test_max_length_concurrency_per_policy_at_100k_blocks() -> None:
    """The README's example: 70 max-length requests under the shared reserve, 16 with vLLM's
    per-request charge, 25 with its pre-fix charge."""
    got = {
        name: max_concurrency(GEMMA4, 100_000, 16384, 2 * STEP, policy(name))
        for name in ADMISSION_POLICIES
    }
    assert got == {"shared": 70, "per-request": 16, "optimistic": 25}
    for name, n in got.items():
        p = policy(name)
        assert blocks_for_requests(GEMMA4, n, 16384, 2 * STEP, p) <= 100_000
        assert blocks_for_requests(GEMMA4, n + 1, 16384, 2 * STEP, p) > 100_000


@pytest.mark.parametrize(
    ("spec", "in_flight", "max_model_len", "cap"),
    [
        (SlidingWindow(16, 1024), 1024, 16384, 129),
        (SlidingWindow(16, 1024), 2048, 16384, 193),
        (ChunkedLocal(16, 1024), 1024, 16384, 128),
        (ChunkedLocal(16, 1024), 2048, 16384, 192),
        (SlidingWindow(16, 1024), 2048, 2000, 125),  # vLLM's 126, capped by the 125-block table
        (Mamba(16), 1024, 16384, 65),
    ],
)
def test_per_request_policy_charges_vllms_admission_caps(spec, in_flight, max_model_len, cap):
    """Scenario 18's caps: cdiv(min(W − 1 + in-flight, len), bs) + 1 (chunked: C + in-flight)."""
    assert PerRequestReserve().request_blocks(spec, max_model_len, in_flight) == cap
    assert PerRequestReserve().pool_blocks(spec, in_flight, 8, max_model_len) == 0


def test_full_attention_is_charged_its_table_under_every_policy() -> None:
    for name in ADMISSION_POLICIES:
        assert policy(name).request_blocks(FullAttention(16), 1000, 4096) == 63
        assert policy(name).pool_blocks(FullAttention(16), 4096, 9, 1000) == 0


@pytest.mark.parametrize("name", ADMISSION_POLICIES)
def test_plan_manager_and_runtime_read_the_same_policy(name: str) -> None:
    sched = SchedulerConfig(max_model_len=8192, max_num_batched_tokens=1024)
    plan = plan_kv(gemma3(), CacheConfig(num_device_blocks=6000, admission=name), sched)
    assert plan.admission.name == name
    mgr = KVCacheManager(
        plan.specs,
        6000,
        max_model_len=8192,
        max_in_flight_tokens=sched.max_in_flight_tokens,
        admission=plan.admission,
    )
    n = plan.max_concurrency()
    assert n == mgr.max_concurrency() >= 1
    assert plan.blocks_for_requests(n, 8192) <= 5999 < plan.blocks_for_requests(n + 1, 8192)


def test_per_request_admits_fewest_and_shared_most_at_max_length() -> None:
    sched = SchedulerConfig(max_model_len=8192, max_num_batched_tokens=4096)
    got = {
        name: plan_kv(gemma3(), CacheConfig(num_device_blocks=20_000, admission=name), sched)
        for name in ADMISSION_POLICIES
    }
    conc = {name: p.max_concurrency() for name, p in got.items()}
    assert conc["per-request"] < conc["optimistic"] < conc["shared"], conc


def test_unknown_admission_policy_names_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--admission must be one of shared, per-request, opti"):
        CacheConfig(admission="vllm")
    with pytest.raises(ValueError, match=r"--admission must be one of"):
        admission_policy("fair", 512)


def test_plan_cli_reports_the_policy_and_refuses_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    assert main(["plan", "--admission", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "--admission" in err and "'bogus'" in err and "per-request" in err
    conc = {}
    for name in ADMISSION_POLICIES:
        out = tmp_path / f"{name}.json"
        args = ["plan", "--admission", name, "--max-model-len", "8192", "--json", str(out)]
        assert main([*args, "--max-num-batched-tokens", "4096"]) == 0
        summary = json.loads(out.read_text())
        assert summary["admission"] == name
        conc[name] = summary["tiers"][0]["max_concurrency_at_max_len"]
        assert f"--admission {name}" in capsys.readouterr().out
    assert conc["per-request"] < conc["optimistic"] < conc["shared"], conc


# ---- the formula is what runtime admission admits --------------------------------------------------


@st.composite
def hybrid_specs(draw: st.DrawFn) -> list[KVSpec]:
    bs = draw(st.sampled_from([4, 8, 16]))
    window = st.builds(SlidingWindow, st.just(bs), st.integers(1, 6 * bs))
    chunked = st.builds(ChunkedLocal, st.just(bs), st.integers(1, 4).map(lambda k: k * bs))
    return [FullAttention(bs), *draw(st.lists(st.one_of(window, chunked), min_size=1, max_size=3))]


class PeakScheduler(Scheduler):
    """Records the most requests running right after any schedule() (before their step ends)."""

    peak = 0

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.peak = max(self.peak, len(self.running))
        return out


def run_max_length_requests(
    specs: list[KVSpec], name: str, n: int, length: int, chunk: int, depth: int
) -> tuple[int, int, int]:
    """A pool sized by the formula for `n` requests of `length` tokens under policy `name`;
    n + 2 such requests (prompt length − 1, one output token) arrive at once and prefill
    `chunk` tokens a step each, so every request admitted is running at once. Returns (most
    running at once, requests finished, preemptions); RuntimeError if the engine stalls."""
    budget = (n + 2) * chunk
    p = admission_policy(name, budget)
    num_blocks = blocks_for_requests(specs, n, length, depth * budget, p) + 1
    kv = KVCacheManager(
        specs,
        num_blocks,
        max_model_len=length,
        max_in_flight_tokens=depth * budget,
        admission=p,
        admit_whole_prompt=True,
    )
    assert kv.max_concurrency() == n
    sched = PeakScheduler(
        kv, max_num_batched_tokens=budget, async_depth=depth, long_prefill_token_threshold=chunk
    )
    reqs = [
        Request(f"r{i}", [1000 * i + t for t in range(length - 1)], StopConditions(max_tokens=1))
        for i in range(n + 2)
    ]
    for r in reqs:
        sched.add_request(r)
    engine = FakeEngine(sched, FakeRunner())
    for _ in range(20_000):
        if not engine.in_flight and not sched.has_unfinished_requests():
            break
        engine.step()
        kv.check_integrity()
    else:
        raise RuntimeError("the engine stalled")
    finished = sum(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    return sched.peak, finished, sched.num_preemptions


@given(
    specs=hybrid_specs(),
    name=st.sampled_from(ADMISSION_POLICIES),
    n=st.integers(1, 4),
    num_blocks=st.integers(2, 12),
    chunk=st.integers(1, 40),
    depth=st.integers(1, 3),
)
def test_pool_sized_for_n_max_length_requests_admits_exactly_n_and_drains(
    specs: list[KVSpec], name: str, n: int, num_blocks: int, chunk: int, depth: int
) -> None:
    """Startup sizing and runtime admission are one formula: with the whole prompt charged at
    admission, n requests of max length run at once, the next waits, and every request
    finishes. The shared and per-request charges cover every block a step in flight holds (no
    preemption); `optimistic` under-charges them under the settled basis and may preempt."""
    length = num_blocks * specs[0].block_size
    most, finished, preemptions = run_max_length_requests(specs, name, n, length, chunk, depth)
    assert most == n and finished == n + 2
    if name != "optimistic":
        assert preemptions == 0


def test_first_chunk_admission_over_admits_at_max_length() -> None:
    """Without the whole-prompt charge (vLLM's --no-scheduler-reserve-full-isl) admission sees
    only each request's first chunk: it admits past the formula and preempts the surplus."""
    specs = [FullAttention(16), SlidingWindow(16, 32)]
    most, finished, _ = run_max_length_requests(specs, "shared", 3, 256, 16, 2)
    assert (most, finished) == (3, 5)
    budget, p = 5 * 16, admission_policy("shared", 80)
    kv = KVCacheManager(
        specs, blocks_for_requests(specs, 3, 256, 2 * budget, p) + 1, max_model_len=256,
        max_in_flight_tokens=2 * budget,
    )  # fmt: skip
    sched = PeakScheduler(kv, max_num_batched_tokens=budget, long_prefill_token_threshold=16)
    for i in range(5):
        sched.add_request(Request(f"r{i}", [1000 * i + t for t in range(255)], StopConditions(1)))
    engine = FakeEngine(sched, FakeRunner())
    while engine.in_flight or sched.has_unfinished_requests():
        engine.step()
    assert sched.peak > 3 and sched.num_preemptions > 0


# ---- state (Mamba) groups ------------------------------------------------------------------------


def falcon_h1() -> ModelConfig:
    return load_model_config("falcon-h1-0.5b")


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


def test_without_prefix_caching_a_state_group_has_one_page_per_request() -> None:
    """architecture.md §Snapshots, mode none: Mamba(max_model_len), one table position updated
    in place, no transient reserve (a request never holds more than its whole table)."""
    sched = SchedulerConfig(max_model_len=16384)
    cache = CacheConfig(kv_cache_memory_bytes=4 * GIB, enable_prefix_caching=False)
    plan = plan_kv(falcon_h1(), cache, sched)
    assert plan.specs == [FullAttention(800), Mamba(16384)]
    assert plan.specs[1].steady_blocks(16384) == 1
    assert plan.specs[1].transient_blocks(sched.max_in_flight_tokens, 12, 16384) == 0
    cached = plan_kv(falcon_h1(), CacheConfig(kv_cache_memory_bytes=4 * GIB), sched)
    assert plan.blocks_per_request(16384) < cached.blocks_per_request(16384)


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
    model = model_config_from_dict(GRANITE_LIKE)
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


def test_plan_command_says_a_state_group_keeps_no_snapshots_without_prefix_caching(
    capsys, tmp_path
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--model", "falcon-h1-0.5b", "--no-enable-prefix-caching"]
    assert run(parser.parse_args(args)) == 0
    text = capsys.readouterr().out
    assert "snapshots" not in text
    assert "one page per request for its whole life" in text
