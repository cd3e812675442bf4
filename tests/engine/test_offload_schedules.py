"""Seeded sim schedules with the host tier on: the sanitizer stays clean (raising at the first
hazard) and every completion equals its prompt run alone, whatever the timing.

One seed fixes everything: the sim device's jitter (op durations drawn from the device's seeded
generator) and copy speed (slow copies keep loads and stores in flight across steps), and the
workload — requests over a few shared prefixes arriving at different steps (so prefixes are
evicted from a tight device pool and come back from the host), aborts, n-gram drafts in some
seeds, eager and lazy store modes, small and large host pools (host eviction, re-stores), four
architectures (hybrid full + sliding, chunked local, sliding only, full attention: it preempts). Async depth 2, NaN poison in recycled
blocks and in load destinations right before their copy. Across the seeds the test counts loads,
stores, host hits, preemptions and rejected drafts and requires each to have happened.

Default run: 100 seeds; `-m slow`: 1,000 (`KVTIER_OFFLOAD_SEEDS=N` overrides the soak's count).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from kvtier.device import OpMeta
from kvtier.device.sim import SimDevice
from kvtier.engine import EngineArgs, EngineCore, FinishedRequest, SamplingParams
from kvtier.model.testing import write_tiny_model
from kvtier.sched.output import PlannedTransfer

ARCHS = ("gemma3", "llama_chunked", "mistral", "llama")
MAX_TOKENS = 12
MAX_MODEL_LEN = 48
BLOCK_SIZE = 4
# Smallest device pool that holds one longest request: 12 blocks per KV-cache group + the null.
MIN_POOL = {"gemma3": 4 * 12 + 1, "llama_chunked": 4 * 12 + 1, "mistral": 12 + 1, "llama": 12 + 1}


@functools.cache
def model(arch: str, root: str) -> Path:
    return write_tiny_model(Path(root) / f"{arch}-schedules", arch, window=8, chunk=8)


def prompt_pool(arch: str) -> list[tuple[int, ...]]:
    """3 shared prefixes × 4 tails, 6 unrelated prompts (they churn the device pool), and 2
    repetitive prompts that n-gram drafting matches."""
    rng = random.Random(f"prompts-{arch}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 300) for _ in range(n)]

    heads = [tokens(rng.choice([16, 20, 24])) for _ in range(3)]
    prompts = [tuple(h + tokens(rng.randrange(1, 9))) for h in heads for _ in range(4)]
    prompts += [tuple(tokens(rng.randrange(20, 31))) for _ in range(6)]
    motif = tokens(3)
    prompts += [tuple(motif * 7), tuple(heads[0][:8] + motif * 6)]
    return prompts


@functools.cache
def alone(path: Path, prompt: tuple[int, ...]) -> list[int]:
    """The prompt run by itself: synchronous, no prefix caching, no host tier."""
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path),
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            async_scheduling=False,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("r", list(prompt), params)
    return engine.drain()["r"].token_ids


@dataclass
class Case:
    """Everything one seed decides."""

    seed: int
    arch: str
    requests: list[tuple[tuple[int, ...], int, int, bool]]  # prompt, max tokens, arrival, abort
    num_device_blocks: int
    num_host_blocks: int
    store_mode: str
    budget: int
    num_spec: int
    jitter: float
    copy_latency_ns: int
    check_every_step: bool

    @classmethod
    def draw(cls, seed: int) -> Case:
        rng = random.Random(seed)
        arch = ARCHS[seed % len(ARCHS)]
        pool = prompt_pool(arch)
        requests = [
            (
                rng.choice(pool),
                rng.randint(1, MAX_TOKENS),
                rng.choice([0, rng.randint(0, 16)]),  # half arrive at once, half spread out
                rng.random() < 0.1,
            )
            for _ in range(rng.randint(5, 9))
        ]
        return cls(
            seed=seed,
            arch=arch,
            requests=requests,
            num_device_blocks=MIN_POOL[arch] + rng.choice([0, 2, 8, 20]),
            num_host_blocks=rng.choice([12, 24, 200]),
            store_mode=rng.choice(["eager", "lazy"]),
            budget=rng.choice([8, 16, 32]),
            num_spec=rng.choice([0, 0, 2]),
            jitter=rng.choice([0.0, 0.3, 0.9]),
            copy_latency_ns=rng.choice([8_000, 150_000, 1_000_000]),
            check_every_step=seed % 4 == 0,
        )


@dataclass
class Tally:
    """What the seeds exercised, summed."""

    counts: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def poison_load_destinations(engine: EngineCore) -> None:
    """NaN-fill each load's destination blocks right before its copy: a block counted as loaded
    that the copy missed would otherwise keep its old (possibly right) content."""
    device, transfers = engine.device, engine.runner.transfers
    launch = transfers.launch_loads

    def launch_loads(planned: list[PlannedTransfer], step_seq: int) -> None:
        for t in planned:
            if t.is_load:
                device.poison_blocks("device", t.dst_block_ids, meta=OpMeta("poison", step_seq))
        launch(planned, step_seq)

    transfers.launch_loads = launch_loads  # type: ignore[method-assign]


def run_case(case: Case, root: str, tally: Tally) -> None:
    path = model(case.arch, root)
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path),
            device="sim",
            sanitize="raise",
            poison=True,
            check_integrity=case.check_every_step,
            seed=case.seed,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            async_scheduling=True,
            async_depth=2,
            num_speculative_tokens=case.num_spec,
            num_device_blocks=case.num_device_blocks,
            num_host_blocks=case.num_host_blocks,
            kv_offload_store_mode=case.store_mode,
            max_num_batched_tokens=case.budget,
        )
    )
    device = engine.device
    assert isinstance(device, SimDevice)
    cost = replace(device.cost_model, jitter=case.jitter, copy_latency_ns=case.copy_latency_ns)
    device.cost_model = cost  # durations now come from the device's generator, seeded above
    poison_load_destinations(engine)
    pending = sorted(enumerate(case.requests), key=lambda item: item[1][2])
    aborted: set[str] = set()
    done: dict[str, FinishedRequest] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, abort) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(f"r{i}", list(prompt), params)
            if abort:
                aborted.add(f"r{i}")
        done |= {o.req_id: o.result for o in engine.step() if o.result is not None}
        step += 1
        if step % 7 == 0:
            for req_id in aborted:
                result = engine.abort(req_id)
                if result is not None:
                    done[req_id] = result
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_hazards == 0
    assert stats.is_idle, stats  # every block came back; no copy, pin or quarantine left
    for i, (prompt, max_tokens, _, _) in enumerate(case.requests):
        state = done[f"r{i}"]
        expected = alone(path, prompt)[:max_tokens]
        if state.finish_reason == "abort":
            assert state.token_ids == expected[: len(state.token_ids)], f"r{i}"
        else:
            assert state.token_ids == expected, f"r{i}"
    m, c = stats.host_metrics, tally.counts
    assert m is not None
    c["seeds"] += 1
    c[f"store mode {case.store_mode}"] += 1
    c["loaded blocks"] += m.num_loaded_blocks
    c["stored blocks"] += m.num_stored_blocks
    c["host hit tokens"] += m.num_hit_tokens
    c["host evictions"] += m.num_evicted_blocks
    c["load waits"] += m.num_load_waits
    c["lazy seeds with loads"] += case.store_mode == "lazy" and m.num_loaded_blocks > 0
    c["preemptions"] += stats.num_preemptions
    c["rejected drafts"] += stats.num_draft_tokens - stats.num_accepted_tokens
    c["aborted"] += sum(done[r].finish_reason == "abort" for r in aborted)
    c["steps"] += step


def run_seeds(seeds: range, root: str) -> Tally:
    tally = Tally()
    start = time.perf_counter()
    for seed in seeds:
        case = Case.draw(seed)
        try:
            run_case(case, root, tally)
        except Exception as exc:
            raise AssertionError(f"seed {seed} failed: {case}") from exc
    tally.seconds = time.perf_counter() - start
    return tally


def assert_exercised(tally: Tally, num_seeds: int) -> None:
    c = tally.counts
    print(f"\n{num_seeds} seeds in {tally.seconds:.1f} s: {dict(c)}")
    assert c["seeds"] == num_seeds
    for what in (
        "loaded blocks",
        "stored blocks",
        "host hit tokens",
        "host evictions",
        "preemptions",
        "rejected drafts",
        "aborted",
        "store mode eager",
        "store mode lazy",
        "lazy seeds with loads",
    ):
        assert c[what] > 0, f"no {what} across {num_seeds} seeds: the schedules are too tame"


def test_100_seeded_sim_schedules_with_offload_are_sanitizer_clean(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = str(tmp_path_factory.mktemp("schedules"))
    assert_exercised(run_seeds(range(100), root), 100)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_1000_seeded_sim_schedules_with_offload_soak(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = str(tmp_path_factory.mktemp("schedules-soak"))
    num_seeds = int(os.environ.get("KVTIER_OFFLOAD_SEEDS", "1000"))
    assert_exercised(run_seeds(range(num_seeds), root), num_seeds)
