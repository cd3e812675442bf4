"""Workloads shared by the engine tests: the mixed prompts (a shared prefix for prefix hits and
host-tier reloads, a short and a long prompt, a repetitive one on which n-gram drafts get
accepted), rounds of a batch, and the end-of-run check."""

from __future__ import annotations

from kvtier.engine import LLM, SamplingParams


def mixed_prompts() -> list[list[int]]:
    shared = [(7 * i) % 300 + 3 for i in range(20)]
    return [
        [*shared, 11, 12, 13],
        [*shared, 21, 22],
        list(range(40, 45)),
        [(5 * i) % 251 + 3 for i in range(37)],
        [*shared[:9], 5, 5, 5, 5, 5, 5, 5, 5],  # repetitive: n-gram drafts get accepted
    ]


def rounds(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, n: int
) -> list[list[tuple[int, ...]]]:
    """`n` rounds of `prompts` as one batch each: each round's tokens per prompt."""
    batch = [{"prompt_token_ids": p} for p in prompts]
    return [
        [tuple(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
        for _ in range(n)
    ]


def check_clean(llm: LLM) -> None:
    """No sanitizer hazard, the pools' integrity holds, and the engine is idle."""
    engine = llm.engine
    assert engine.stats().num_hazards == 0
    engine.check_integrity()
    assert engine.stats().is_idle
