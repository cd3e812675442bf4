"""Outputs are a function of the requests only: not of async depth, caching, chunking, drafts,
policy or preemptions (fake runner with position-determined tokens)."""

from __future__ import annotations

import itertools
import zlib

import pytest

from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import ChunkedLocal, FullAttention, KVSpec, Mamba, SlidingWindow
from kvtier.sampling import StopConditions
from kvtier.sched import Request, RequestStatus
from tests.sched.factories import scheduler
from tests.sched.fake_engine import FakeEngine
from tests.sched.invariants import check_scheduler, window_violations
from tests.sched.oracle import AccessOracle

SPECS: dict[str, list[KVSpec]] = {
    "full": [FullAttention(16)],
    "swa": [SlidingWindow(16, 32)],
    "hybrid": [FullAttention(16), SlidingWindow(16, 24), ChunkedLocal(16, 64)],
    "mamba": [FullAttention(16), Mamba(16)],
}


def periodic_token(req_id: str, position: int) -> int:
    """A per-request repeating pattern (period 5-9) so n-gram drafts are often right."""
    seed = zlib.crc32(req_id.encode())
    period = 5 + seed % 5
    return 100 + (seed + (position % period) * 7) % 40


def workload(n: int = 10, use_ngram: bool = False) -> list[Request]:
    shared = list(range(200, 248))  # 3 blocks shared by half the requests
    reqs = []
    for i in range(n):
        own = [1000 * (i + 1) + j for j in range(5 + 11 * i % 37)]
        prompt = (shared if i % 2 else []) + own
        stop = (periodic_token(f"r{i}", len(prompt) + 3),) if i % 3 == 0 else ()
        sp = StopConditions(
            max_tokens=4 + (i * 7) % 23, stop_token_ids=stop, min_tokens=2, use_ngram=use_ngram
        )
        reqs.append(Request(f"r{i}", prompt, sp))
    return reqs


def run(
    specs: list[KVSpec],
    *,
    depth: int,
    caching: bool = True,
    num_blocks: int = 40,
    k: int = 0,
    acceptance: float | None = None,
    **kw: object,
) -> tuple[dict[str, list[int]], dict[str, RequestStatus], int]:
    sched = scheduler(
        num_blocks,
        specs,
        depth=depth,
        budget=64,
        caching=caching,
        max_model_len=512,
        num_speculative_tokens=k,
        **kw,
    )
    oracle = AccessOracle(specs, sched.kv.get_block_ids)
    runner = FakeRunner(
        token_fn=periodic_token, oracle=oracle, acceptance_rate=acceptance, num_speculative_tokens=k
    )
    engine = FakeEngine(sched, runner)
    reqs = workload(use_ngram=k > 0)
    for r in reqs:
        sched.add_request(r)
    for _ in range(5000):
        if not engine.in_flight and not sched.has_unfinished_requests():
            break
        engine.step()
        check_scheduler(sched)
        assert window_violations(sched) == []
    assert oracle.violations == []
    assert not sched.requests and sched.num_in_flight_tokens == 0
    assert sched.kv.num_free_blocks == num_blocks - 1
    return (
        {r.request_id: r.output_token_ids for r in reqs},
        {r.request_id: r.status for r in reqs},
        sched.num_preemptions,
    )


# Pools tight enough to preempt; window groups without the transient reserve so that a handful
# of blocks suffices (the reserve is a capacity policy, not a safety rule).
TIGHT = {"full": (16, None), "swa": (10, 0), "hybrid": (18, 0), "mamba": (16, 0)}


@pytest.mark.parametrize("name", SPECS)
def test_same_outputs_across_depth_and_caching(name: str) -> None:
    num_blocks, in_flight = TIGHT[name]
    results = {
        (depth, caching): run(
            SPECS[name],
            depth=depth,
            caching=caching,
            num_blocks=num_blocks,
            max_in_flight_tokens=in_flight,
        )
        for depth, caching in itertools.product((1, 2, 3), (True, False))
    }
    reference = results[(1, True)]
    for key, (outputs, statuses, _) in results.items():
        assert outputs == reference[0], key
        assert statuses == reference[1], key
    assert any(s is RequestStatus.FINISHED_STOPPED for s in reference[1].values())
    assert sum(p for _, _, p in results.values()) > 0, "the pool should force preemptions"


@pytest.mark.parametrize("acceptance", [None, 0.0, 0.6])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_same_outputs_with_drafts(depth: int, acceptance: float | None) -> None:
    base = run(SPECS["hybrid"], depth=1, num_blocks=200)
    spec = run(SPECS["hybrid"], depth=depth, num_blocks=60, k=3, acceptance=acceptance)
    assert spec[0] == base[0] and spec[1] == base[1]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_same_outputs_with_chunking_and_policy(policy: str) -> None:
    base = run(SPECS["swa"], depth=1, num_blocks=200)
    other = run(SPECS["swa"], depth=2, long_prefill_token_threshold=8, policy=policy)
    assert other[0] == base[0] and other[1] == base[1]


def test_drafts_are_accepted_by_matching_truth() -> None:
    sched = scheduler(200, depth=1, budget=64, num_speculative_tokens=3)
    runner = FakeRunner(token_fn=periodic_token, num_speculative_tokens=3)
    r = Request("r0", [1, 2, 3], StopConditions(max_tokens=60, use_ngram=True))
    sched.add_request(r)
    steps = FakeEngine(sched, runner).run()
    assert runner.num_accepted_tokens > 30
    assert steps < 60  # fewer steps than tokens: drafts paid off
    assert r.output_token_ids == [periodic_token("r0", 3 + i) for i in range(60)]
