"""The host tier in the engine: with a device pool too small to keep the prefixes, later rounds
load them back from host memory — and every completion equals the run without offload, on the sim
device with the sanitizer raising and NaN poison in recycled blocks, on every architecture and in
both store modes (`--kv-offload-store-mode eager|lazy`)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.config import STORE_MODES, CacheConfig
from kvtier.device import OpMeta
from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams, TransferFaults
from kvtier.engine.cli import add_engine_arguments, engine_args
from kvtier.model.testing import ARCHITECTURES, write_tiny_model
from kvtier.sched.output import PlannedTransfer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BASE = {
    "max_model_len": 64,
    "block_size": 4,
    "max_num_batched_tokens": 32,
    "device": "sim",
    "sanitize": True,
    "poison": True,
    "check_integrity": True,
}
SIM_CHECKED = {k: BASE[k] for k in ("device", "sanitize", "poison", "check_integrity")}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 40))] for _ in range(8)]


def rounds(path: Path, **kw: object) -> tuple[list[list[list[int]]], LLM]:
    """Three rounds of the same prompts (later rounds hit whatever cache kept them)."""
    llm = LLM(str(path), **{**BASE, **kw})
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outs = [
        [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        for _ in range(3)
    ]
    return outs, llm


@pytest.fixture(scope="module")
def reference(gemma3: Path) -> list[list[list[int]]]:
    return rounds(gemma3, num_device_blocks=400)[0]


@pytest.mark.parametrize(
    "protect", ["event,settled,quarantine", "event", "settled,quarantine", "event,quarantine"]
)
def test_offload_reloads_evicted_prefixes_with_the_same_tokens(
    gemma3: Path, reference: list[list[list[int]]], protect: str
) -> None:
    outs, llm = rounds(gemma3, num_device_blocks=80, num_host_blocks=400, protect=protect)
    assert outs == reference
    stats = llm.engine.stats()
    m = stats.host_metrics
    assert m is not None
    assert m.num_loaded_blocks > 0 and m.num_stored_blocks > 0
    assert stats.num_hazards == 0
    llm.engine.check_integrity()


def test_stores_race_the_forward_without_settled_counts_or_the_event(gemma3: Path) -> None:
    """H1: with stores planned from the optimistic count and no compute-done event, a store
    reads a block before the forward that writes it; the sanitizer reports the RAW."""
    from kvtier.device import RaceError

    with pytest.raises(RaceError) as info:
        rounds(gemma3, num_device_blocks=80, num_host_blocks=400, protect="none")
    assert {h.kind for h in info.value.hazards} == {"RAW"}
    assert all(
        h.first.meta.label == "store" or h.second.meta.label == "store" for h in info.value.hazards
    )


def test_failed_loads_roll_back_and_recompute_with_the_same_tokens(
    gemma3: Path, reference: list[list[list[int]]]
) -> None:
    """H7: every other load reports failure; its request rolls back to its last good block and
    recomputes the rest, and no completion changes."""
    llm = LLM(str(gemma3), **{**BASE, "num_device_blocks": 80, "num_host_blocks": 400})
    llm.engine.set_transfer_faults(TransferFaults(fail_loads_every=2))
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outs = [
        [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        for _ in range(3)
    ]
    assert outs == reference
    m = llm.engine.stats().host_metrics
    assert m is not None and m.num_failed_loads > 0
    llm.engine.check_integrity()


# ---- store mode: an engine / CLI option ------------------------------------------------------


def test_store_mode_flag_parses_into_the_cache_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args(parser.parse_args(["--kv-offload-store-mode", "lazy"]))
    assert args.cache.kv_offload_store_mode == "lazy"
    assert engine_args(parser.parse_args([])).cache.kv_offload_store_mode == "eager"
    assert "lazy_offload" in parser.format_help()  # vLLM users find their knob


def test_a_bad_store_mode_names_the_flag_and_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier.cli import main

    with pytest.raises(ValueError, match=r"--kv-offload-store-mode must be eager or lazy, got 'x'"):
        CacheConfig(kv_offload_store_mode="x")
    with pytest.raises(ValueError, match="--kv-offload-store-mode"):
        EngineArgs.from_kwargs(None, kv_offload_store_mode="lazy_offload")
    assert main(["generate", "hi", "--kv-offload-store-mode", "sometimes"]) == 2
    err = capsys.readouterr().err
    assert "--kv-offload-store-mode must be eager or lazy, got 'sometimes'" in err


def test_lazy_store_mode_stores_near_eviction_and_later_hits_the_host(
    gemma3: Path, reference: list[list[list[int]]]
) -> None:
    outs, llm = rounds(
        gemma3, num_device_blocks=80, num_host_blocks=400, kv_offload_store_mode="lazy"
    )
    stats = llm.engine.stats()
    m = stats.host_metrics
    assert m is not None and stats.host_store_mode == "lazy"
    assert m.num_stored_blocks > 0 and m.num_loaded_blocks > 0
    assert m.num_hit_tokens > 0
    assert outs == reference
    llm.engine.check_integrity()


# ---- offload on vs off: the same greedy tokens on every architecture ------------------------

# KV-cache groups of each tiny architecture (the device pool is shared by the groups).
GROUPS = {"llama": 1, "llama_chunked": 4, "qwen2": 4, "mistral": 1, "gemma2": 2, "gemma3": 4}
SMALL_POOL = {"max_model_len": 40, "async_scheduling": True, "async_depth": 2}
SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
Baseline = tuple[Path, list[list[list[int]]]]


@pytest.fixture(scope="module")
def offload_off(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Baseline]:
    """arch -> (tiny model folder, outputs of `two_rounds` without the host tier), cached."""
    cache: dict[str, Baseline] = {}

    def get(arch: str) -> Baseline:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-offload")
            path = write_tiny_model(root, arch, window=8, chunk=8)
            outs, llm, _ = two_rounds(path, GROUPS[arch])
            assert llm.engine.stats().host is None
            cache[arch] = (path, outs)
        return cache[arch]

    return get


def shared_prefix_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two long shared prefixes with short tails, and distinct prompts that churn the device."""
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 300) for _ in range(n)]

    heads = [tokens(24) for _ in range(2)]
    return [h + tokens(rng.randrange(1, 6)) for h in heads * 2], [tokens(28) for _ in range(4)]


def two_rounds(
    path: Path, groups: int, **kw: object
) -> tuple[list[list[list[int]]], LLM, list[int]]:
    """Shared-prefix prompts, churn that evicts their prefixes from the device, the prompts
    again (their prefixes come back from the host tier, or are recomputed without one).

    Load destinations are poisoned too, right before their copy: a block the request counts as
    loaded but the copy missed would otherwise still hold its old (possibly right) content.
    Returns the outputs per batch, the engine, and every device block id poisoned."""
    pool = {"num_device_blocks": 40 * groups}  # 10 per group holds one longest request
    llm = LLM(str(path), **{**BASE, **SMALL_POOL, **pool, **kw})
    assert len(llm.engine.plan.specs) == groups
    device, transfers = llm.engine.device, llm.engine.runner.transfers
    poison, launch_loads = device.poison_blocks, transfers.launch_loads
    poisoned: list[int] = []

    def counting(tier: str, block_ids: list[int], **kw: object) -> object:
        poisoned.extend(block_ids if tier == "device" else [])
        return poison(tier, block_ids, **kw)  # type: ignore[arg-type]

    def poisoning_loads(planned: list[PlannedTransfer], step_seq: int) -> None:
        for t in planned:
            if t.is_load:
                device.poison_blocks("device", t.dst_block_ids, meta=OpMeta("poison", step_seq))
        launch_loads(planned, step_seq)

    device.poison_blocks = counting  # type: ignore[method-assign,assignment]
    transfers.launch_loads = poisoning_loads  # type: ignore[method-assign]
    shared, churn = shared_prefix_prompts()
    outs = [
        [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], SHORT, use_tqdm=False)
        ]
        for batch in (shared, churn, shared)
    ]
    return outs, llm, poisoned


@pytest.mark.parametrize("store_mode", STORE_MODES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_offload_on_and_off_give_the_same_greedy_tokens_on_every_architecture(
    offload_off: Callable[[str], Baseline], arch: str, store_mode: str
) -> None:
    """Device pool too small for the prefixes: they are evicted there and reloaded from the host
    into recycled (NaN-poisoned) blocks; async depth 2, sanitizer raising, integrity checked
    after every step. The same pool without the host tier recomputes them instead."""
    path, off = offload_off(arch)
    host = {"num_host_blocks": 200, "kv_offload_store_mode": store_mode}
    outs, llm, poisoned = two_rounds(path, GROUPS[arch], **host)
    engine = llm.engine
    stats = engine.stats()
    m = stats.host_metrics
    assert m is not None and stats.host_store_mode == store_mode
    assert m.num_hit_tokens > 0 and m.num_loaded_blocks > 0 and m.num_stored_blocks > 0
    assert len(poisoned) > len(set(poisoned))  # blocks were recycled (and poisoned each time)
    assert stats.num_hazards == 0
    assert outs == off
    engine.check_integrity()


def test_requests_whose_load_completed_do_not_deadlock_the_head_of_the_queue(
    tmp_path: Path,
) -> None:
    """Regression: a request whose host load completed waits (holding its blocks) until its turn;
    a preempted request put back at the head of the queue needed those blocks, nothing ran, and
    the engine stepped forever. The head now takes the parked blocks back (they stay cached)."""
    path = write_tiny_model(tmp_path, "llama")
    rng = random.Random(0)
    heads = [[rng.randrange(3, 300) for _ in range(20)] for _ in range(2)]
    prompts = [h + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 9))] for h in heads * 3]
    kw = {"max_model_len": 48, "block_size": 4, "max_num_batched_tokens": 8}
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path), **SIM_CHECKED, **kw, num_device_blocks=13, num_host_blocks=200
        )
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = 0
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done |= {o.req_id: o.result.token_ids for o in engine.step() if o.result is not None}
        steps += 1
        assert steps < 500, "no progress: a parked request holds the blocks the head needs"
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.host_metrics is not None and stats.host_metrics.num_loaded_blocks > 0
    reference = LLM(str(path), **kw, enable_prefix_caching=False, async_scheduling=False)
    outs = reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [done[f"r{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in outs]
    engine.check_integrity()
