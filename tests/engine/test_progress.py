"""Progress (architecture.md §Progress): with a pool that holds one request at max length, every
admitted request finishes — whatever the admission policy, tier, async depth, drafts, prompt
logprobs — checked by a watchdog that fails a run where a request starves, not by a hang."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.kv.plan import plan_kv
from kvtier.model.hf_config import load_model_config
from kvtier.model.testing import write_tiny_model
from tests.engine.workloads import Watchdog

# The smallest pool one max-length request fits: admission by first chunk, one chunk a step.
MINIMAL = {
    "dtype": "float64",
    "block_size": 5,
    "max_model_len": 20,
    "max_num_batched_tokens": 5,
    "num_device_blocks": 5,
    "num_host_blocks": 15,
    "scheduler_reserve_full_isl": False,
    "check_integrity": True,
}
BOUND = 200  # steps without a token: far above any schedule of these few requests


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mistral-progress")
    return write_tiny_model(folder, "mistral", hidden_size=32, vocab_size=300, window=16)


def engine(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineArgs.from_kwargs(str(path), **{**MINIMAL, **kw}))


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def alone(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    e = engine(path, num_host_blocks=None, enable_prefix_caching=False, async_scheduling=False)
    e.add_request("alone", prompt, greedy(max_tokens))
    return e.drain()["alone"].token_ids


def prefix_on_host(e: EngineCore, rng: random.Random) -> list[int]:
    """A 10-token prompt run once, then evicted from the device by two others: its blocks are on
    the host tier only."""
    prefix = [rng.randrange(3, 290) for _ in range(10)]
    e.add_request("owner", prefix, greedy(2))
    e.drain()
    for i in range(2):
        e.add_request(f"churn{i}", [rng.randrange(3, 290) for _ in range(15)], greedy(2))
        e.drain()
    return prefix


@pytest.mark.parametrize("admission", ["shared", "per-request", "optimistic"])
@pytest.mark.parametrize(
    "mode",
    [
        {"device": "sim", "async_scheduling": False},
        {"device": "cpu", "async_scheduling": False},
        {"device": "sim", "async_depth": 2},
        {"device": "sim", "async_depth": 3},
        {"device": "cpu", "async_depth": 3},
        {"device": "sim", "async_scheduling": False, "num_speculative_tokens": 2},
        {"device": "sim", "async_depth": 2, "num_speculative_tokens": 2},
    ],
    ids=["sim-sync", "cpu-sync", "sim-async2", "sim-async3", "cpu-async3", "drafts", "drafts-a2"],
)
def test_prompt_logprobs_do_not_starve_behind_a_loaded_request(
    mistral: Path, admission: str, mode: dict[str, object]
) -> None:
    """Issue 41's livelock: `b`'s prefix is on the host only; its load completes and it waits
    holding the loaded blocks, while `a` (prompt logprobs: it computes every position) is
    admitted by its first chunk, cannot grow, and preempted itself forever, each time put back
    ahead of `b`. Now the running request takes back the loaded blocks before it preempts itself."""
    rng = random.Random(0)
    e = engine(mistral, admission=admission, **mode)
    prefix = prefix_on_host(e, rng)
    prompts = {"b": prefix + [rng.randrange(3, 290) for _ in range(3)]}
    prompts["a"] = [rng.randrange(3, 290) for _ in range(12)]
    dog = Watchdog(e, BOUND)
    e.add_request("b", prompts["b"], greedy(4))
    e.add_request("a", prompts["a"], greedy(4, prompt_logprobs=1))
    dog.add("b")
    dog.add("a")
    done = dog.drain()
    stats = e.stats()
    assert stats.host_metrics is not None and stats.host_metrics.num_loaded_blocks > 0
    for name, prompt in prompts.items():
        assert done[name].token_ids == alone(mistral, prompt, 4), name
    e.check_integrity()
    assert e.stats().is_idle


# ---- random workloads on minimal pools: progress and tokens --------------------------------------

ADMISSIONS = ("shared", "per-request", "optimistic")
REFERENCES: dict[tuple[Path, int], EngineCore] = {}


@pytest.fixture(scope="module")
def models(mistral: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("gemma3-progress")
    gemma3 = write_tiny_model(folder, "gemma3", hidden_size=32, vocab_size=300, window=8)
    return [mistral, gemma3]


def reference(path: Path, max_model_len: int, prompt: list[int], max_tokens: int) -> list[int]:
    """The prompt alone: synchronous, no prefix caching, a roomy pool (one engine per model and
    length limit, one request at a time)."""
    if (path, max_model_len) not in REFERENCES:
        REFERENCES[path, max_model_len] = engine(
            path,
            max_model_len=max_model_len,
            num_host_blocks=None,
            num_device_blocks=64,
            enable_prefix_caching=False,
            async_scheduling=False,
            scheduler_reserve_full_isl=True,
        )
    e = REFERENCES[path, max_model_len]
    e.add_request("alone", prompt, greedy(max_tokens))
    return e.drain()["alone"].token_ids


def minimal_pool(path: Path, args: dict[str, object]) -> int:
    """Device blocks of the smallest pool the engine accepts: one request at max length."""
    probe = EngineArgs.from_kwargs(str(path), **{**args, "num_device_blocks": 1 << 12})
    plan = plan_kv(load_model_config(path), probe.cache, probe.scheduler)
    return plan.blocks_per_request(plan.max_model_len) + 1


def check_minimal_pool_workload(models: list[Path], seed: int) -> None:
    """One random run: first-chunk admission, a host tier holding an evicted prefix, prompt
    logprobs, aborts and arrivals over time, on the smallest pool the engine accepts. Every
    request that was not aborted gets the tokens of its prompt alone; none starves."""
    rng = random.Random(seed)
    path = rng.choice(models)
    depth = rng.choice([1, 2, 3])
    max_model_len = rng.choice([16, 20, 24])
    args: dict[str, object] = {
        **MINIMAL,
        "device": "cpu" if rng.random() < 0.2 else "sim",
        "max_model_len": max_model_len,
        "block_size": rng.choice([4, 5]),
        "max_num_batched_tokens": rng.choice([4, 5, 8]),
        "async_scheduling": depth > 1,
        "async_depth": depth,
        "num_speculative_tokens": rng.choice([0, 0, 2]),
        "admission": rng.choice(ADMISSIONS),
        "num_host_blocks": rng.choice([8, 15, 40]),
    }
    if args["device"] == "sim":
        args |= {"sanitize": True, "poison": True}
    args["num_device_blocks"] = minimal_pool(path, args)
    e = EngineCore(EngineArgs.from_kwargs(str(path), **args))

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 290) for _ in range(n)]

    prefix = toks(rng.choice([4, 8, 10]))
    e.add_request("owner", prefix, greedy(2))
    e.drain()
    e.add_request("churn", toks(max_model_len // 2), greedy(2))  # evicts the prefix
    e.drain()
    requests = []
    for i in range(rng.randint(2, 4)):
        own = toks(rng.randint(1, max_model_len - 1 - len(prefix)))
        prompt = (prefix + own) if rng.random() < 0.6 else toks(rng.randint(1, max_model_len - 1))
        logprobs = 1 if rng.random() < 0.4 else None
        arrive, abort = rng.randint(0, 3), (rng.randint(0, 12) if rng.random() < 0.15 else None)
        requests.append((f"r{i}", prompt, rng.randint(1, 8), logprobs, arrive, abort))
    dog = Watchdog(e, 1000)
    done = {}
    aborted = set()
    step = 0
    while step <= 3 or e.has_unfinished_requests():
        for rid, prompt, max_tokens, logprobs, arrive, abort in requests:
            if arrive == step:
                e.add_request(rid, prompt, greedy(max_tokens, prompt_logprobs=logprobs))
                dog.add(rid)
            if abort is not None and arrive + abort == step and rid not in done:
                result = e.abort(rid)
                dog.forget(rid)
                if result is not None:
                    done[rid], _ = result, aborted.add(rid)
        done |= {o.req_id: o.result for o in dog.step() if o.result is not None}
        step += 1
    for rid, prompt, max_tokens, _, _, _ in requests:
        want = reference(path, max_model_len, prompt, max_tokens)
        got = done[rid].token_ids
        assert got == (want[: len(got)] if rid in aborted else want), (rid, args)
    e.check_integrity()
    assert e.stats().is_idle
    assert e.stats().num_hazards == 0
    e.close()


# Seeds 2, 66 and 100 livelocked before the rule of §Progress (a request preempting itself forever)
@pytest.mark.parametrize("seed", [*range(6), 66, 100])
def test_random_workloads_on_minimal_pools_progress(models: list[Path], seed: int) -> None:
    check_minimal_pool_workload(models, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 2006))
def test_random_workloads_on_minimal_pools_soak(models: list[Path], seed: int) -> None:
    check_minimal_pool_workload(models, seed)


def test_a_head_request_takes_back_the_blocks_of_a_loaded_request_behind_it(
    mistral: Path,
) -> None:
    """With nothing running, `h` (ranked first) cannot get its blocks while `b`, whose host load
    completed, waits behind it holding them: admission takes them back (each would otherwise
    wait on the other forever)."""
    rng = random.Random(3)
    e = engine(mistral, policy="priority", scheduler_reserve_full_isl=True)
    prefix = prefix_on_host(e, rng)
    prompts = {"b": prefix + [rng.randrange(3, 290) for _ in range(3)]}
    prompts["h"] = [rng.randrange(3, 290) for _ in range(15)]
    dog = Watchdog(e, BOUND)
    e.add_request("b", prompts["b"], greedy(4), priority=1)
    dog.add("b")
    dog.step()  # b's load starts
    e.add_request("h", prompts["h"], greedy(4), priority=0)
    dog.add("h")
    done = dog.drain()
    for name, prompt in prompts.items():
        assert done[name].token_ids == alone(mistral, prompt, 4), name
    assert e.stats().is_idle
