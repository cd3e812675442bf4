"""What `/health` trusts: a heartbeat the engine loop stamps on every pass (in shared memory, so
the HTTP process reads an engine process's beat without a message that a stopped process could
not send), and the warm-up forward that runs before the server first answers."""

from __future__ import annotations

import multiprocessing
import time

from kvtier.engine.core import EngineCore
from kvtier.engine.params import SamplingParams

# /health answers 503 once the engine loop has not passed for this long (ServerConfig's default);
# an idle loop passes at least every quarter of it, so only a hung step, a stuck engine or a
# stopped process goes quiet that long.
ITERATION_TIMEOUT_S = 30.0
WARMUP_REQ_ID = "kvtier-warmup"


class Heartbeat:
    """The monotonic time of the engine loop's last pass. CLOCK_MONOTONIC is one clock for every
    process of the machine, so an engine process stamps it and the HTTP process reads its age.
    Pass it to a spawned process as a `Process` argument (shared memory travels only then)."""

    def __init__(self) -> None:
        self._stamp = multiprocessing.get_context("spawn").RawValue("d", time.monotonic())

    def beat(self) -> None:
        self._stamp.value = time.monotonic()

    def age_s(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - float(self._stamp.value)


def stall_reason(heartbeat: Heartbeat, iteration_timeout_s: float) -> str | None:
    """Why the engine loop counts as stuck (no pass within `iteration_timeout_s`), or None."""
    age = heartbeat.age_s()
    if age <= iteration_timeout_s:
        return None
    return (
        f"the engine loop has not advanced for {age:.1f} s (deadline {iteration_timeout_s:g} s, "
        "--engine-iteration-timeout-s): the engine is hung or its process is stopped"
    )


def warm_up(engine: EngineCore) -> None:
    """One request of a few tokens through a prefill and a decode, before the server answers: the
    native kernels are built and the first forward's one-off costs paid here, not on a client's
    first request. Shorter than a block, so it caches and stores nothing."""
    block_size = engine.plan.block_size
    num_tokens = max(1, min(8, block_size - 2))
    token_ids = [i % engine.model_config.vocab_size for i in range(1, num_tokens + 1)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(WARMUP_REQ_ID, token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
