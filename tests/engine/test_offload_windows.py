"""Window blocks reach the host tier (issue 12 item 18): a step that settles a prefill chunk
longer than the window prunes its window blocks in the same update, so they are stored before
they are pruned, and a shared prefix is restorable from the host on a hybrid model (full +
sliding window, like the embedded default) exactly as on a full-attention one."""

from __future__ import annotations

import random

import pytest

from kvtier.engine import EngineArgs, EngineCore, FinishedRequest, SamplingParams
from kvtier.model.testing import write_tiny_model

SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CHECKED = {"device": "sim", "sanitize": "raise", "poison": True, "check_integrity": True}


@pytest.fixture(scope="module", params=["llama", "gemma3", "embedded"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """Tiny full-attention and hybrid (window 32) models, and the embedded default (hybrid,
    window 64)."""
    arch = request.param
    if arch == "embedded":
        return None
    return str(write_tiny_model(tmp_path_factory.mktemp(f"{arch}-w32"), arch, window=32))


def engine(path: str | None, **kw: object) -> EngineCore:
    args = {**CHECKED, "block_size": 16, "max_model_len": 256, **kw}
    return EngineCore(EngineArgs.from_kwargs(path, **args))


def run(e: EngineCore, name: str, prompt: list[int]) -> FinishedRequest:
    e.add_request(name, prompt, SHORT)
    return e.drain()[name]


def test_a_shared_prefix_comes_back_from_the_host_on_every_architecture(
    model: str | None,
) -> None:
    """A 161-token prompt settles in one step (10 full blocks per group; a 32-token window
    keeps 2, a 64-token one 4). Every group stores all 10 (before: the window groups only what
    their window kept). After the device cache is reset, a request sharing the first 64 tokens
    gets a 64-token host hit on every model (before: 0 on the hybrid ones) and the tokens of its
    prompt run alone."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, 300) for _ in range(161)]
    shared = prompt[:64] + [rng.randrange(3, 300) for _ in range(40)]
    e = engine(model, num_host_blocks=200)
    run(e, "a", prompt)
    groups = len(e.plan.specs)
    s = e.stats()
    assert s.is_idle and s.host_metrics is not None
    assert s.host_metrics.num_stored_blocks == 10 * groups
    assert e.reset_prefix_cache()
    b = run(e, "b", shared)
    assert b.num_cached_tokens == 64
    s = e.stats()
    assert s.host_metrics is not None and s.host_metrics.num_loaded_blocks >= 4
    assert b.token_ids == run(engine(model, enable_prefix_caching=False), "alone", shared).token_ids
    assert e.stats().is_idle
