"""Workloads shared by the engine tests: the mixed prompts (a shared prefix for prefix hits and
host-tier reloads, a short and a long prompt, a repetitive one on which n-gram drafts get
accepted), rounds of a batch, each request alone (the reference of every equivalence matrix), and
the end-of-run checks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier.engine import (
    LLM,
    CompletionOutput,
    EngineCore,
    FinishedRequest,
    SamplingParams,
    StepOutput,
)


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
    llm: LLM, prompts: list[list[int]], params: SamplingParams, n: int, bound: int = 1000
) -> list[list[tuple[int, ...]]]:
    """`n` rounds of `prompts` as one batch each: each round's tokens per prompt. No request
    may wait more than `bound` steps for a token (`Watchdog`)."""
    engine, out = llm.engine, []
    for r in range(n):
        dog = Watchdog(engine, bound)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"round{r}-{i}", prompt, params)
            dog.add(f"round{r}-{i}")
        done = dog.drain()
        out.append([tuple(done[f"round{r}-{i}"].token_ids) for i in range(len(prompts))])
    return out


def alone(
    model: str | None, config: dict[str, Any], requests: Iterable[tuple[list[int], SamplingParams]]
) -> list[CompletionOutput]:
    """Each request alone, in an engine of its own with `config`, synchronous and without prefix
    caching: the outputs every scheduling mode is held to."""
    out = []
    for prompt, params in requests:
        llm = LLM(model, **{**config, "async_scheduling": False, "enable_prefix_caching": False})
        got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        out.append(got[0].outputs[0])
    return out


def check_mode_effects(llm: LLM, config: dict[str, Any]) -> None:
    """The mode `config` did what it is in a matrix for: a tight pool without a host tier
    preempted, the host tier loaded blocks back, n-gram drafting proposed drafts."""
    stats = llm.engine.stats()
    host = "num_host_blocks" in config
    if "num_device_blocks" in config and not host:
        assert stats.num_preemptions > 0
    if host:
        assert stats.host_metrics is not None and stats.host_metrics.num_loaded_blocks > 0
    if "num_speculative_tokens" in config:
        assert stats.num_draft_tokens > 0


def check_clean(llm: LLM) -> None:
    """No sanitizer hazard, the pools' integrity holds, and the engine is idle."""
    engine = llm.engine
    assert engine.stats().num_hazards == 0
    engine.check_integrity()
    assert engine.stats().is_idle


class Watchdog:
    """The liveness invariant (architecture.md §Progress): while the engine has work, no request
    goes more than `bound` engine steps without a token. Feed it every `step()`'s outputs."""

    def __init__(self, engine: EngineCore, bound: int) -> None:
        self.engine = engine
        self.bound = bound
        self.num_steps = 0
        self.last_token: dict[str, int] = {}  # unfinished request → step of its last token

    def add(self, req_id: str) -> None:
        self.last_token[req_id] = self.num_steps

    def forget(self, req_id: str) -> None:
        self.last_token.pop(req_id, None)

    def step(self) -> list[StepOutput]:
        """One engine step; AssertionError naming the request that starved past the bound."""
        outs = self.engine.step()
        self.num_steps += 1
        for out in outs:
            if out.finished:
                self.forget(out.req_id)
            elif out.new_token_ids:
                self.last_token[out.req_id] = self.num_steps
        for req_id, seen in self.last_token.items():
            waited = self.num_steps - seen
            assert waited <= self.bound, (
                f"{req_id} got no token in {waited} steps (bound {self.bound}): no progress; "
                f"{self.engine.stats().num_preemptions} preemptions so far"
            )
        return outs

    def drain(self) -> dict[str, FinishedRequest]:
        """Step until nothing is unfinished, checking liveness; the finished requests by id."""
        done: dict[str, FinishedRequest] = {}
        while self.engine.has_unfinished_requests():
            done |= {o.req_id: o.result for o in self.step() if o.result is not None}
        return done
