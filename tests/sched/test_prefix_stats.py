"""Prefix-cache counters count each request once, when it is admitted (issue 12 item 8), as
vLLM: a request that waits several steps for blocks, or retries while another request loads its
prefix, is looked up on every retry but counted once. Re-admissions after preemption are counted
apart (`num_preempted_*`, as vLLM's preempted counters)."""

from __future__ import annotations

from kvtier.bench.fake_runner import FakeRunner
from kvtier.kv import FullAttention, KVCacheManager
from kvtier.sampling import StopConditions
from kvtier.sched import Request, Scheduler
from tests.sched.fake_engine import FakeEngine


def _run(num_blocks: int) -> tuple[Scheduler, list[Request]]:
    """16 requests over 4 shared 32-token prefixes, all at once, on a pool that holds few."""
    kv = KVCacheManager(
        [FullAttention(16)], num_blocks, max_model_len=512, max_in_flight_tokens=512
    )
    sched = Scheduler(kv, max_num_batched_tokens=256, async_depth=2)
    reqs = []
    for i in range(16):
        prefix = [1000 * (i % 4) + j + 1 for j in range(32)]
        tail = [50_000 + 100 * i + j for j in range(8 + i % 5)]
        reqs.append(Request(f"r{i}", prefix + tail, StopConditions(max_tokens=24)))
        sched.add_request(reqs[-1])
    steps_waited = {r.request_id: 0 for r in reqs}
    engine = FakeEngine(sched, FakeRunner())
    while engine.queue or sched.has_unfinished_requests():
        engine.step()
        for r in sched.waiting:
            steps_waited[r.request_id] += 1
    assert sum(steps_waited.values()) > 3 * len(reqs), "requests should wait several steps"
    return sched, reqs


def test_a_waiting_request_is_counted_once_when_admitted() -> None:
    sched, reqs = _run(num_blocks=14)
    stats = sched.kv.stats
    assert stats.num_requests == len(reqs)
    assert stats.num_query_tokens == sum(r.num_prompt_tokens for r in reqs)
    assert stats.num_hit_tokens == sum(r.num_cached_tokens for r in reqs) > 0
    preempted = [r for r in reqs if r.num_preemptions]
    assert stats.num_preempted_requests == sum(r.num_preemptions for r in reqs)
    assert (stats.num_preempted_requests > 0) == bool(preempted)
