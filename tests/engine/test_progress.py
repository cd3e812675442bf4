"""Progress (architecture.md §Progress): with a pool that holds one request at max length, every
admitted request finishes — whatever the admission policy, tier, async depth, drafts, prompt
logprobs — checked by a watchdog that fails a run where a request starves, not by a hang."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.engine import EngineArgs, EngineCore, SamplingParams
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
    prefix = [rng.randrange(3, 290) for _ in range(10)]
    e.add_request("owner", prefix, greedy(2))
    e.drain()
    for i in range(2):  # evict the prefix from the device: it is on the host only
        e.add_request(f"churn{i}", [rng.randrange(3, 290) for _ in range(15)], greedy(2))
        e.drain()
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
