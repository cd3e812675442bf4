"""Random workloads through the whole engine on the sim device, with the race sanitizer raising at
the first hazard and NaN poison in recycled blocks: every completion must equal the same prompt run
alone, synchronously, without prefix caching — whatever the async depth, drafts, pool size, chunk
budget, host tier, arrival pattern and aborts — and no request may wait more than a bounded number
of steps for a token (architecture.md §Progress): a livelock fails the run instead of hanging it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.engine import EngineArgs, EngineCore, FinishedRequest, SamplingParams
from kvtier.model.testing import write_tiny_model
from tests.engine.workloads import Watchdog

MODEL = {}
BOUND = 500  # steps without a token: far above any schedule of six short requests


def model_path(tmp_root: Path) -> Path:
    if "gemma3" not in MODEL:
        MODEL["gemma3"] = write_tiny_model(tmp_root / "gemma3-props", "gemma3", window=8)
    return MODEL["gemma3"]


@functools.cache
def alone(path: Path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path),
            max_model_len=64,
            block_size=4,
            async_scheduling=False,
            enable_prefix_caching=False,
        )
    )
    engine.add_request(
        "r", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    return engine.drain()["r"].token_ids


prompt_st = st.lists(st.integers(3, 40), min_size=1, max_size=30).map(tuple)
workload_st = st.lists(
    st.tuples(prompt_st, st.integers(1, 12), st.integers(0, 4), st.booleans()),  # prompt, max
    min_size=1,  # tokens, arrival step, aborted
    max_size=6,
)


ENGINE_GIVEN = given(
    workload=workload_st,
    depth=st.sampled_from([1, 2, 3]),
    num_spec=st.sampled_from([0, 0, 2]),
    num_blocks=st.sampled_from([70, 100, 400]),
    budget=st.sampled_from([8, 16, 64]),
    caching=st.booleans(),
    host_blocks=st.sampled_from([0, 0, 200]),
)


# 25 workloads by default (each runs a whole engine); KVTIER_ENGINE_EXAMPLES=N for more.
@settings(
    max_examples=int(os.environ.get("KVTIER_ENGINE_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@ENGINE_GIVEN
def test_random_workloads_match_each_prompt_alone(
    tmp_path_factory: pytest.TempPathFactory, **case: object
) -> None:
    check_workload(tmp_path_factory, **case)  # type: ignore[arg-type]


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@ENGINE_GIVEN
def test_random_workloads_soak(tmp_path_factory: pytest.TempPathFactory, **case: object) -> None:
    check_workload(tmp_path_factory, **case)  # type: ignore[arg-type]


def check_workload(
    tmp_path_factory: pytest.TempPathFactory,
    workload: list[tuple[tuple[int, ...], int, int, bool]],
    depth: int,
    num_spec: int,
    num_blocks: int,
    budget: int,
    caching: bool,
    host_blocks: int,
) -> None:
    path = model_path(tmp_path_factory.getbasetemp())
    engine = EngineCore(
        EngineArgs.from_kwargs(
            str(path),
            device="sim",
            sanitize=True,
            poison=True,
            check_integrity=True,
            max_model_len=64,
            block_size=4,
            async_scheduling=depth > 1,
            async_depth=depth,
            num_speculative_tokens=num_spec,
            num_device_blocks=num_blocks,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching or host_blocks > 0,
            num_host_blocks=host_blocks or None,
        )
    )
    pending = sorted(enumerate(workload), key=lambda item: item[1][2])
    dog = Watchdog(engine, BOUND)
    step = 0
    aborted: set[str] = set()
    done: dict[str, FinishedRequest] = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, abort) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(f"r{i}", list(prompt), params)
            dog.add(f"r{i}")
            if abort and step % 2:
                aborted.add(f"r{i}")
        done |= {out.req_id: out.result for out in dog.step() if out.result is not None}
        assert engine.num_unfinished_requests() == engine.stats().num_unfinished_requests
        step += 1
        if step == 3:
            for req_id in aborted:
                result = engine.abort(req_id)
                dog.forget(req_id)
                if result is not None:
                    done[req_id] = result
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_pending_stores == 0
    assert stats.device.num_free == stats.device.num_blocks  # everything came back
    for i, (prompt, max_tokens, _, _) in enumerate(workload):
        state = done[f"r{i}"]
        expected = alone(path, prompt, max_tokens)
        if f"r{i}" in aborted and state.finish_reason == "abort":
            assert state.token_ids == expected[: len(state.token_ids)]
        else:
            assert state.token_ids == expected
