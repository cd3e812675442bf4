"""The host tier under injected faults (`EngineCore.set_transfer_faults`), checked through the
public inspection surface (`EngineCore.stats()`): aborts while a load is in flight, persistently
bad host copies, slow copies. Sim device, sanitizer raising, NaN poison, integrity every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.engine import EngineArgs, EngineCore, SamplingParams, TransferFaults
from kvtier.model.testing import write_tiny_model

SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama-faults"), "llama")


def engine(path: Path, **kw: object) -> EngineCore:
    """16 usable device blocks of 4 tokens (one 64-token request), a 63-block host tier."""
    args = {
        "device": "sim",
        "sanitize": "raise",
        "poison": True,
        "check_integrity": True,
        "block_size": 4,
        "max_model_len": 64,
        "num_device_blocks": 17,
        "num_host_blocks": 64,
        **kw,
    }
    return EngineCore(EngineArgs.from_kwargs(str(path), **args))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


def host_only_prefix(e: EngineCore, rng: random.Random) -> list[int]:
    """Run a 32-token prompt (stored to the host), then churn that evicts it from the device:
    the next request with that prefix loads it from the host. Returns the prompt."""
    prefix = tokens(rng, 32)
    e.add_request("owner", prefix, SHORT)
    e.drain()
    for i in range(2):
        e.add_request(f"churn{i}", tokens(rng, 40), SHORT)
    e.drain()
    assert e.stats().is_idle
    return prefix


def output_alone(path: Path, prompt: list[int]) -> list[int]:
    e = engine(path, num_host_blocks=None, enable_prefix_caching=False, async_scheduling=False)
    e.add_request("alone", prompt, SHORT)
    return e.drain()["alone"].token_ids


def test_abort_while_loading_keeps_the_engine_stepping_until_the_load_lands(
    llama: Path,
) -> None:
    """Item 20: the aborted request's load still pins device and host blocks until its copy
    completes; pending loads are pending work, so drain() steps until they are released."""
    rng = random.Random(0)
    e = engine(llama)
    prefix = host_only_prefix(e, rng)
    e.set_transfer_faults(TransferFaults(delay_polls=4))  # the load stays in flight 4 steps
    e.add_request("b", prefix + tokens(rng, 4), SHORT)
    e.step()
    s = e.stats()
    assert s.num_loading == 1 and s.num_pending_loads == 1 and s.device.num_load_pins == 8
    assert s.host is not None and s.host.num_load_pins == 8
    assert e.abort("b") is not None
    assert e.has_unfinished_requests()  # nothing runs, but the cancelled load pins blocks
    e.drain()
    s = e.stats()
    assert s.is_idle, s
    assert s.host_metrics is not None and s.host_metrics.num_loaded_blocks == 0  # cancelled


def test_a_persistently_bad_host_copy_fails_one_load_not_every_later_one(llama: Path) -> None:
    """Item 21: the owner's store leaves bad host copies; the first request loading them fails
    and recomputes. The failed entries are evicted from the host, so the recomputed blocks are
    stored afresh and the next request loads good copies (before: every later request with the
    prefix failed its load and recomputed). Every output equals the prompt run alone."""
    rng = random.Random(1)
    e = engine(llama)
    e.set_transfer_faults(TransferFaults(corrupt_stores=1))  # the owner's one store
    prefix = host_only_prefix(e, rng)
    prompts = {}
    done = {}
    for name in ("b", "c"):
        prompts[name] = prefix + tokens(rng, 4)
        e.add_request(name, prompts[name], SHORT)
        done[name] = e.drain()[name]
        for i in range(2):  # evict the prefix from the device again
            e.add_request(f"{name}-churn{i}", tokens(rng, 40), SHORT)
        e.drain()
    s = e.stats()
    assert s.is_idle, s
    m = s.host_metrics
    assert m is not None and m.num_failed_loads == 1 and m.num_loaded_blocks == 8
    for name, prompt in prompts.items():
        assert done[name].token_ids == output_alone(llama, prompt), name


def test_requests_retrying_behind_a_slow_load_are_counted_once(llama: Path) -> None:
    """Item 8: `b` loads the prefix slowly; `c` and `d` share it and retry every step while that
    load is in flight (each retry looks up the device and the host again). Each request counts
    once, when admitted: device queries are the prompt lengths, host queries one per request
    that consulted the host, host hits the tokens actually loaded."""
    rng = random.Random(2)
    e = engine(llama)
    prefix = host_only_prefix(e, rng)
    before = e.stats()
    e.set_transfer_faults(TransferFaults(delay_polls=4))
    prompts = {name: prefix + tokens(rng, 4) for name in "bcd"}
    for name, prompt in prompts.items():
        e.add_request(name, prompt, SHORT)
    e.drain()
    s = e.stats()
    assert s.is_idle
    assert s.host_metrics is not None and before.host_metrics is not None
    m, m0 = s.host_metrics, before.host_metrics
    assert m.num_load_waits - m0.num_load_waits >= 4  # c and d retried behind b's load
    p, p0 = s.prefix_cache, before.prefix_cache
    assert p.num_requests - p0.num_requests == 3
    assert p.num_query_tokens - p0.num_query_tokens == sum(len(x) for x in prompts.values())
    assert p.num_hit_tokens - p0.num_hit_tokens == 2 * 32  # c and d hit what b loaded
    assert m.num_queries - m0.num_queries == 3
    assert m.num_hit_tokens - m0.num_hit_tokens == 32  # b's load, once
    assert m.num_loaded_blocks - m0.num_loaded_blocks == 8


def test_stats_show_the_quarantine_by_release_step_and_the_pins_of_a_slow_store(
    llama: Path,
) -> None:
    """A request aborted while its next step is in flight: its blocks are quarantined until
    that step is processed, and `stats()` says so; a slow store pins its device sources."""
    rng = random.Random(3)
    e = engine(llama)
    e.set_transfer_faults(TransferFaults(delay_polls=3))
    e.add_request("r", tokens(rng, 30), SamplingParams(max_tokens=20, temperature=0))
    while e.stats().num_pending_stores == 0:
        e.step()
    s = e.stats()
    assert s.device.num_store_pins > 0 and s.host is not None and s.host.num_store_pins > 0
    assert s.num_steps_in_flight > 0 and not s.is_idle
    assert e.abort("r")
    s = e.stats()
    [(release, refs)] = s.device.quarantined_refs_by_step
    assert release == s.num_steps and refs == s.device.num_quarantined_refs > 0
    assert s.num_running == s.num_waiting == 0 and not s.device.is_idle
    e.drain()
    s = e.stats()
    assert s.is_idle and s.device.num_quarantined_refs == 0 and s.device.num_cached > 0
