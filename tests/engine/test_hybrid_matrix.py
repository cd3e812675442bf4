"""The engine equivalence matrix on the Mamba2 hybrids (Falcon-H1: attention and a mixer in every
layer; Granite 4.0 hybrid: one or the other per layer), on the `cpu` backend and on `sim`, with the
race sanitizer raising and NaN poison in recycled blocks: every mode must give each prompt the
tokens it gets when run alone, synchronously, with no cache (architecture.md §State)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams, TransferFaults
from kvtier.model.testing import write_tiny_model
from kvtier.offload.loads import LoadPlanner
from kvtier.offload.types import Transfer
from tests.engine import workloads
from tests.engine.workloads import check_clean, check_mode_effects, mixed_prompts, rounds
from tests.model.reference import hf_logits, hf_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Small states: with --block-size 4 the hybrid block size is raised to 8 (an attention page of
# 4 KV heads × 16 dims holds a state page), so a 64-token request spans 8 blocks.
STATE = {"num_kv_heads": 4, "mamba_d_state": 4, "mamba_n_groups": 1}
SMALL = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 64}
CHECKED = {"sanitize": True, "poison": True, "check_integrity": True}
# admitting on the first chunk alone over-admits into a pool this small: preemptions
TIGHT = {"max_num_batched_tokens": 8, "scheduler_reserve_full_isl": False}
TIGHT_BLOCKS = {"falcon_h1": 14, "granite_hybrid": 21}  # one max-length request needs 13, 20
TIGHT_DRAFT_BLOCKS = {"falcon_h1": 14, "granite_hybrid": 24}  # with 2 drafts: 13, 23
# the host tier: a device pool that evicts the shared prefix between rounds, a large host pool
HOST = {"num_host_blocks": 400}
HOST_BLOCKS = {"falcon_h1": 28, "granite_hybrid": 42}
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async2": {"async_depth": 2},
    "async3": {"async_depth": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-prefix-cache-async3": {"enable_prefix_caching": False, "async_depth": 3},
    "tight-pool-preempts": TIGHT,
    "tight-pool-preempts-sync": {**TIGHT, "async_scheduling": False},
    "tight-pool-preempts-drafts-async3": {**TIGHT, "num_speculative_tokens": 2, "async_depth": 3},
    "chunked-prefill": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 5},
    "chunked-prefill-odd": {"max_num_batched_tokens": 7},
    "ngram-drafts-sync": {"num_speculative_tokens": 2, "async_scheduling": False},
    "ngram-drafts": {"num_speculative_tokens": 3},
    "ngram-drafts-async3": {"num_speculative_tokens": 2, "async_depth": 3},
    "ngram-drafts-no-prefix-cache": {"num_speculative_tokens": 3, "enable_prefix_caching": False},
    "host-eager": HOST,
    "host-lazy": {**HOST, "kv_offload_store_mode": "lazy"},
    "host-async3-drafts": {**HOST, "async_depth": 3, "num_speculative_tokens": 2},
}
ARCHS = ["falcon_h1", "granite_hybrid"]
DEVICES = ["cpu", "sim"]


# Falcon-H1 with sliding-window attention in two of its three layers (a kvtier toy: `layer_types`
# is not a Falcon-H1 key in transformers): window, full and state groups side by side
WINDOWED = {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


@functools.cache
def model(arch: str, folder: Path) -> Path:
    if arch == "falcon_h1_windowed":
        return write_tiny_model(folder / arch, "falcon_h1", **STATE, **WINDOWED, sliding_window=12)
    return write_tiny_model(folder / arch, arch, **STATE)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-matrix")
    return {arch: model(arch, root) for arch in [*ARCHS, "falcon_h1_windowed"]}


@functools.cache
def alone(folder: Path, kv_cache_dtype: str | None = None) -> tuple[tuple[int, ...], ...]:
    """Each prompt alone, on the cpu backend."""
    config = {**SMALL, "kv_cache_dtype": kv_cache_dtype}
    outs = workloads.alone(str(folder), config, [(p, GREEDY) for p in mixed_prompts()])
    return tuple(tuple(o.token_ids) for o in outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_run_is_transformers_greedy(arch: str, models: dict[str, Path]) -> None:
    """Each prompt alone through the engine gives `transformers`' greedy continuation (one full
    forward per token, no cache), so every mode below is checked against the model itself."""
    reference = hf_model(models[arch], torch.float32)
    for prompt, got in zip(mixed_prompts(), alone(models[arch]), strict=True):
        tokens = list(prompt)
        for _ in range(GREEDY.max_tokens or 0):
            tokens.append(int(hf_logits(reference, tokens)[-1].argmax()))
        assert list(got) == tokens[len(prompt) :]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_gives_each_prompt_its_tokens_alone(
    arch: str, mode: str, device: str, models: dict[str, Path]
) -> None:
    config = MODES[mode]
    if mode.startswith("tight-pool"):
        tight = TIGHT_DRAFT_BLOCKS if "num_speculative_tokens" in config else TIGHT_BLOCKS
        config = {**config, "num_device_blocks": tight[arch]}
    if "num_host_blocks" in config:
        config = {**config, "num_device_blocks": HOST_BLOCKS[arch]}
    check_mode(models[arch], config, device)


def check_mode(
    folder: Path, config: dict[str, Any], device: str, kv: str | None = None, hits: bool = True
) -> None:
    llm = LLM(str(folder), **{**SMALL, **CHECKED, "device": device, **config}, kv_cache_dtype=kv)
    # later rounds restore the shared prefix from state snapshots (prefix caching on), from the
    # host tier too when it is on
    host = "num_host_blocks" in config
    n = 3 if host else 2
    assert rounds(llm, mixed_prompts(), GREEDY, n) == [list(alone(folder, kv))] * n
    check_clean(llm)
    check_mode_effects(llm, config)
    stats = llm.engine.stats()
    if hits and config.get("enable_prefix_caching", True):  # of new or of preempted requests
        cache = stats.prefix_cache
        assert cache.num_hit_tokens + cache.num_preempted_hit_tokens > 0
    if "num_speculative_tokens" in config:  # some drafts rejected, some accepted
        assert 0 < llm.engine.num_accepted_tokens < llm.engine.num_draft_tokens


def test_a_verification_step_longer_than_a_state_block_is_refused(
    models: dict[str, Path],
) -> None:
    """A rejected draft lands its state on the page of its start or of its end: a step of k + 1
    tokens must fit one state block (architecture.md §Rollback)."""
    with pytest.raises(ValueError, match="num_speculative_tokens 8"):
        LLM(str(models["falcon_h1"]), **SMALL, num_speculative_tokens=8)


FAULTS = {  # the host tier with failing or slow copies
    "failing-loads": TransferFaults(fail_loads_every=2),
    "slow-copies": TransferFaults(delay_polls=2),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_host_tier_loads_each_state_snapshot_with_its_attention_blocks(
    arch: str, fault: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """architecture.md §Tiering: a load restores one boundary for every group — the attention
    blocks up to it and, per state group, the one snapshot page at it — or nothing; failing or
    slow copies change no token (a failed load recomputes from 0)."""
    loads: list[Transfer] = []
    plan_load = LoadPlanner.plan_load

    def record(self: LoadPlanner, *args: Any) -> Transfer | None:
        transfer = plan_load(self, *args)
        if transfer is not None:
            loads.append(transfer)
        return transfer

    monkeypatch.setattr(LoadPlanner, "plan_load", record)
    config = {**SMALL, **CHECKED, **HOST, "num_device_blocks": HOST_BLOCKS[arch], "device": "sim"}
    llm = LLM(str(models[arch]), **config)
    llm.engine.set_transfer_faults(FAULTS[fault])
    assert rounds(llm, mixed_prompts(), GREEDY, 3) == [list(alone(models[arch]))] * 3
    check_clean(llm)
    state_groups = llm.engine.runner.state_groups
    assert loads and state_groups
    for transfer in loads:
        assert set(transfer.group_ids) == set(range(len(llm.engine.plan.specs)))
        assert all(transfer.group_ids.count(g) == 1 for g in state_groups)


def test_states_are_planned_in_the_run_dtype_not_the_configs(models: dict[str, Path]) -> None:
    """--dtype float64 on a float32 folder: the state pages hold float64 states (found by
    `kvtier bench garble`, which runs in float64: 'a page of 512 elements cannot hold a state of
    920')."""
    llm = LLM(str(models["falcon_h1"]), **SMALL, **CHECKED, device="sim", dtype="float64")
    mamba = llm.engine.model_config.mamba
    assert mamba is not None and llm.engine.plan.state_page_bytes == mamba.state_elems * 8
    out = llm.generate({"prompt_token_ids": mixed_prompts()[0]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    check_clean(llm)


@pytest.mark.parametrize("mode", ["async3", "ngram-drafts-async3", "host-async3-drafts"])
def test_window_full_and_state_groups_together(mode: str, models: dict[str, Path]) -> None:
    """The windowed Falcon-H1 toy (the garble benchmark's hybrid): three kinds of group, pruned
    windows beside state snapshots, on sim with the sanitizer raising."""
    folder = models["falcon_h1_windowed"]
    config = MODES[mode]
    if "num_host_blocks" in config:
        config = {**config, "num_device_blocks": 98}  # one max-length request needs 49
    llm = LLM(str(folder), **{**SMALL, **CHECKED, "device": "sim", **config})
    kinds = {type(spec).__name__ for spec in llm.engine.plan.specs}
    assert kinds == {"FullAttention", "SlidingWindow", "Mamba"}
    assert rounds(llm, mixed_prompts(), GREEDY, 2) == [list(alone(folder))] * 2
    check_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_aborts_at_every_step_leave_the_others_tokens_alone(
    arch: str, models: dict[str, Path]
) -> None:
    """Abort one request after each number of steps (while loading from the host, prefilling,
    verifying drafts, with three steps in flight): the others get their tokens alone, the aborted
    one a prefix of its own, and the engine drains to idle with no hazard."""
    folder = models[arch]
    expected = alone(folder)
    host = {**HOST, "num_device_blocks": HOST_BLOCKS[arch]}
    kw = {**SMALL, **CHECKED, **host, "device": "sim", "async_depth": 3}
    engine = EngineCore(EngineArgs.from_kwargs(str(folder), **kw, num_speculative_tokens=2))
    for abort_after in range(0, 12, 3):
        got: dict[str, list[int]] = {}
        for i, p in enumerate(mixed_prompts()):
            engine.add_request(f"r{abort_after}-{i}", p, GREEDY)
            got[f"r{abort_after}-{i}"] = []
        victim = f"r{abort_after}-{abort_after % len(mixed_prompts())}"
        steps = 0
        while engine.has_unfinished_requests():
            if steps == abort_after:
                engine.abort(victim)
            for out in engine.step():
                got[out.req_id] += out.new_token_ids
            steps += 1
        for i, want in enumerate(expected):
            tokens = tuple(got[f"r{abort_after}-{i}"])
            victim_i = f"r{abort_after}-{i}" == victim
            assert tokens == want[: len(tokens)] if victim_i else tokens == want
        assert engine.stats().num_hazards == 0
        assert engine.stats().is_idle
    engine.check_integrity()


def test_draft_pages_come_out_of_the_memory_budget(models: dict[str, Path]) -> None:
    """runner/draft_states.py: a hybrid's draft pages (max_num_seqs × k per state group) are pool
    rows beyond the KV manager's blocks, paid from --kv-cache-memory-bytes, not on top of it."""
    budget = 400_000
    kw = {**SMALL, "device": "sim", "kv_cache_memory_bytes": budget, "max_num_seqs": 4}
    plain = LLM(str(models["falcon_h1"]), **kw).engine
    drafting = LLM(str(models["falcon_h1"]), **kw, num_speculative_tokens=2).engine
    per_block = drafting.plan.bytes_per_block
    draft_pages = 4 * 2  # max_num_seqs × k × one state group
    assert drafting.device.num_blocks("device") * per_block <= budget
    assert drafting.device.num_blocks("device") == drafting.plan.tiers[0].num_blocks + draft_pages
    assert drafting.plan.tiers[0].num_blocks == plain.plan.tiers[0].num_blocks - draft_pages
    with pytest.raises(ValueError, match="draft pages"):
        LLM(str(models["falcon_h1"]), **{**kw, "max_num_seqs": 64}, num_speculative_tokens=3)


# 8-bit KV doubles a hybrid's block size (its attention page must still hold a state page)
KV8_MODES: dict[str, dict[str, Any]] = {
    "async3": MODES["async3"],
    "no-prefix-cache-async3": MODES["no-prefix-cache-async3"],
    "chunked-prefill": MODES["chunked-prefill"],
    "ngram-drafts-async3": MODES["ngram-drafts-async3"],
    "host-eager": HOST,
}
KV8_HOST_BLOCKS = {"falcon_h1": 14, "granite_hybrid": 21, "falcon_h1_windowed": 20}


@pytest.mark.parametrize(
    ("mode", "kv"), [*((m, "fp8") for m in sorted(KV8_MODES)), ("chunked-prefill", "fp8_e5m2")]
)
@pytest.mark.parametrize("arch", [*ARCHS, "falcon_h1_windowed"])
def test_8bit_kv_gives_each_prompt_its_tokens_alone(
    arch: str, mode: str, kv: str, models: dict[str, Path]
) -> None:
    """Attention layers read and write fp8 codes while the Mamba states keep the model's dtype in
    the same pages: every mode gives each prompt the tokens it gets alone with the same KV dtype,
    under the sanitizer and NaN poison."""
    config = KV8_MODES[mode]
    host = "num_host_blocks" in config
    if host:  # its blocks of twice the tokens: the prefixes come back from the host tier only
        config = {**config, "num_device_blocks": KV8_HOST_BLOCKS[arch]}
    check_mode(models[arch], config, "cpu", kv, hits=not host)


@pytest.mark.parametrize("arch", ARCHS)
def test_state_snapshots_come_back_from_the_disk_tier(
    arch: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """The tier chain below the host (architecture.md §Chain) keeps state pages like any block:
    with a device pool and a host tier too small for the prefixes, later rounds restore them from
    disk — every group to one boundary — with the tokens each prompt gets alone."""
    folder = models[arch]
    tiers = {"num_device_blocks": HOST_BLOCKS[arch], "num_host_blocks": 12}
    disk = {"kv_disk_path": str(tmp_path), "kv_tier_timeout_s": 30.0}  # hits, not deadline races
    llm = LLM(str(folder), **SMALL, **CHECKED, **tiers, **disk, device="sim")
    try:
        assert rounds(llm, mixed_prompts(), GREEDY, 3) == [list(alone(folder))] * 3
        check_clean(llm)
        got = llm.engine.stats().tier("disk")
        assert got is not None and got.metrics.num_promoted_blocks > 0
    finally:
        llm.engine.close()
