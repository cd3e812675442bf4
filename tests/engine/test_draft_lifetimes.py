"""Window blocks pruned while a step that declared a lower start is in flight (issue 12 item
19). A step launched while earlier drafts were unverified declares its window from the lowest
start a rollback allows; once those drafts verify, the settled count passes that start and
pruning frees blocks the step may still gather. They must be quarantined until that step is
processed, whether or not any draft is unverified *now* (the stamp looked only at those, so
a step without drafts of its own — its budget was spent — left them unguarded: the sanitizer
raised a WAR between the re-poisoned block and the in-flight forward; the tokens were intact)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine import EngineArgs, EngineCore, SamplingParams

# Found by a seeded search: two requests, budget 4 (so `b` sometimes gets one token: no drafts)
A = [204, 75, 25, 74, 60, 277, 121, 74, 78, 19, 34, 72, 121, 277, 232, 272, 214, 107, 50, 63]
A += [13, 209, 177, 104, 108, 172, 203, 189]
B = [114, 216, 283, 33, 29, 95, 185, 71, 107, 78]


def engine(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineArgs.from_kwargs(str(path), block_size=3, max_model_len=96, **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("offset", [1, 7])
def test_blocks_a_lower_start_may_read_stay_quarantined_after_its_drafts_verify(
    gemma3: Path, offset: int
) -> None:
    e = engine(
        gemma3,
        device="sim",
        sanitize="raise",
        poison=True,  # a block handed out again is NaN-filled by the host at once
        check_integrity=True,
        async_depth=3,
        num_speculative_tokens=2,
        enable_prefix_caching=False,  # freed blocks are handed out first
        max_num_batched_tokens=4,
        long_prefill_token_threshold=2,
    )
    e.add_request("a", A, greedy(25))
    done = {}
    for _ in range(offset):
        done |= {o.req_id: o.result for o in e.step() if o.result is not None}
    e.add_request("b", B, greedy(34))
    done |= e.drain()  # raised RaceError (WAR: 'poison' … writes what 'forward' … read)
    assert e.stats().num_accepted_tokens > 0
    assert e.stats().is_idle
    alone = engine(gemma3, async_scheduling=False, enable_prefix_caching=False)
    for name, prompt, n in (("a", A, 25), ("b", B, 34)):
        alone.add_request(name, prompt, greedy(n))
        assert done[name].token_ids == alone.drain()[name].token_ids, name
