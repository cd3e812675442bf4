"""The engine equivalence matrix, on the `cpu` backend (streams are threads: races are physical)
and on `sim` (the deterministic model of it), with the race sanitizer raising and NaN poison in
recycled blocks on both: every scheduling mode must give each prompt the tokens it gets when run
alone, synchronously, with no cache — sync, async depth 2 and 3, n-gram drafts, preemption under a
tight pool, chunked prefill, prefix caching on and off, the host tier in both store modes, failing
and slow loads, and aborts at every point of a request's life. Throughout, no request may wait more
than a bounded number of steps for a token (architecture.md §Progress)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams, TransferFaults
from tests.engine import workloads
from tests.engine.workloads import Watchdog, check_clean, check_mode_effects, mixed_prompts, rounds

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 64}
CHECKED = {"sanitize": True, "poison": True, "check_integrity": True}
# admitting on the first chunk alone over-admits into this pool: preemptions
TIGHT = {"num_device_blocks": 70, "max_num_batched_tokens": 16, "scheduler_reserve_full_isl": False}
HOST = {"num_device_blocks": 80, "num_host_blocks": 400}
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async2": {"async_depth": 2},
    "async3": {"async_depth": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "tight-pool-preempts": TIGHT,
    "tight-pool-preempts-sync": {**TIGHT, "async_scheduling": False},
    "only-quarantine": {**TIGHT, "protect": "event,quarantine"},
    "ngram-drafts": {"num_speculative_tokens": 3},
    "ngram-drafts-sync": {"num_speculative_tokens": 2, "async_scheduling": False},
    "async3-drafts": {"async_depth": 3, "num_speculative_tokens": 2},
    "chunked-prefill": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
    "host-eager": HOST,
    "host-lazy": {**HOST, "kv_offload_store_mode": "lazy"},
    "host-async3-drafts": {**HOST, "async_depth": 3, "num_speculative_tokens": 2},
    # first-chunk admission over-admits while later rounds load prefixes from the host
    "tight-pool-host": {**TIGHT, "num_host_blocks": 400},
}
FAULTS = {  # the host tier with failing or slow copies
    "failing-loads": TransferFaults(fail_loads_every=2),
    "slow-copies": TransferFaults(delay_polls=2),
    "bad-host-copies": TransferFaults(corrupt_stores=6),
}
DEVICES = ["cpu", "sim"]


@functools.cache
def alone(model: Path) -> tuple[tuple[int, ...], ...]:
    """Each prompt alone, on the cpu backend."""
    outs = workloads.alone(str(model), SMALL, [(p, GREEDY) for p in mixed_prompts()])
    return tuple(tuple(o.token_ids) for o in outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_gives_each_prompt_its_tokens_alone(
    mode: str, device: str, gemma3: Path
) -> None:
    config = MODES[mode]
    llm = LLM(str(gemma3), **{**SMALL, **CHECKED, "device": device, **config})
    n = 3 if "num_host_blocks" in config else 1  # later rounds load prefixes back from the host
    assert rounds(llm, mixed_prompts(), GREEDY, n) == [list(alone(gemma3))] * n
    check_clean(llm)
    check_mode_effects(llm, config)
    if "num_speculative_tokens" in config:  # the repetitive prompt's drafts are accepted
        assert llm.engine.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_failing_and_slow_copies_change_no_token(fault: str, device: str, gemma3: Path) -> None:
    llm = LLM(str(gemma3), **{**SMALL, **CHECKED, **HOST, "device": device})
    llm.engine.set_transfer_faults(FAULTS[fault])
    assert rounds(llm, mixed_prompts(), GREEDY, 3) == [list(alone(gemma3))] * 3
    check_clean(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_depth", [1, 2, 3])
def test_aborts_at_every_step_leave_the_others_tokens_alone(
    async_depth: int, device: str, gemma3: Path
) -> None:
    """Abort one request after each number of steps (while waiting, loading, prefilling,
    decoding, with steps in flight): the others get their tokens alone, the aborted one a prefix
    of its own, and the engine drains to idle."""
    expected = alone(gemma3)
    for abort_after in range(0, 12, 2):
        kw = {**SMALL, **CHECKED, **HOST, "device": device, "async_depth": async_depth}
        engine = EngineCore(EngineArgs.from_kwargs(str(gemma3), **kw))
        got: dict[str, list[int]] = {}
        dog = Watchdog(engine, 1000)
        for i, p in enumerate(mixed_prompts()):
            engine.add_request(f"r{i}", p, GREEDY)
            dog.add(f"r{i}")
            got[f"r{i}"] = []
        victim = f"r{abort_after % len(mixed_prompts())}"
        steps = 0
        while engine.has_unfinished_requests():
            if steps == abort_after:
                engine.abort(victim)
                dog.forget(victim)
            for out in dog.step():
                got[out.req_id] += out.new_token_ids
            steps += 1
        for i, want in enumerate(expected):
            tokens = tuple(got[f"r{i}"])
            assert tokens == want[: len(tokens)] if f"r{i}" == victim else tokens == want
        assert engine.stats().num_hazards == 0
        assert engine.stats().is_idle
