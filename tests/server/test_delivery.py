"""How the engine thread hands events to its outlets: once per pass of its loop, admissions'
`Started` with the step's deltas (through an engine process's pipe, one message per step
instead of one more per admitted request), each request's events in order."""

from __future__ import annotations

import threading
from typing import Any

from kvtier.engine.params import EngineArgs, SamplingParams
from kvtier.server import EngineLoop
from kvtier.server.events import Delta, Event, Failed, Sink, Started, Submission
from tests.server.conftest import wait_until


class Recorder:
    """An outlet that keeps each delivery as it came."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[Any, Event]]] = []
        self._lock = threading.Lock()

    def deliver(self, batch: list[tuple[Any, Event]]) -> None:
        with self._lock:
            self.batches.append(list(batch))

    def events(self) -> list[tuple[Any, Event]]:
        with self._lock:
            return [e for b in self.batches for e in b]


def _held(loop: EngineLoop) -> threading.Event:
    """Hold the engine thread until the returned event is set, so commands queue up behind it
    and are handled in one pass."""
    gate = threading.Event()
    loop.call_soon(lambda engine: gate.wait(30))
    return gate


def test_admissions_of_one_pass_go_out_together_then_once_per_step() -> None:
    loop = EngineLoop(EngineArgs.from_kwargs(None, max_model_len=512, torch_threads=1), 64)
    loop.start()
    out = Recorder()
    try:
        gate = _held(loop)
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        for i in range(6):  # queued while it waits: handled in one pass once it goes on
            sub = Submission(f"r{i}", [5 + i, 6, 7, 8, 9], params, Sink(out, f"r{i}"))
            loop.submit(sub)
        gate.set()

        def finished() -> int:
            return sum(
                isinstance(e, Delta) and e.finish_reason is not None for _, e in out.events()
            )

        wait_until(lambda: finished() == 6)
    finally:
        loop.stop()
    first = out.batches[0]
    assert [k for k, e in first if isinstance(e, Started)] == [f"r{i}" for i in range(6)]
    assert len(out.batches) <= loop.num_steps + 1  # one delivery a pass, not one per admission
    for i in range(6):
        mine = [e for k, e in out.events() if k == f"r{i}"]
        assert isinstance(mine[0], Started) and all(isinstance(e, Delta) for e in mine[1:])
        assert sum(len(e.token_ids) for e in mine[1:] if isinstance(e, Delta)) == 4
        assert [e.finish_reason for e in mine[1:] if isinstance(e, Delta)][-1] == "length"


def test_a_failing_step_first_sends_what_the_pass_decided() -> None:
    """A refusal queued in the pass that then fails still reaches its request (it is not in
    flight, so the failure drain would not answer it), and before the failure."""
    loop = EngineLoop(
        EngineArgs.from_kwargs(None, max_model_len=64, torch_threads=1), 64, fail_at_step=1
    )
    loop.start()
    out = Recorder()
    try:
        gate = _held(loop)
        params = SamplingParams(max_tokens=4)
        loop.submit(Submission("ok", [5, 6, 7], params, Sink(out, "ok")))
        loop.submit(Submission("long", list(range(5, 200)), params, Sink(out, "long")))
        gate.set()
        wait_until(lambda: len(out.events()) == 3)
    finally:
        loop.stop()
    assert loop.error is not None
    mine = {k: [e for kk, e in out.events() if kk == k] for k in ("ok", "long")}
    assert isinstance(mine["ok"][0], Started) and isinstance(mine["ok"][1], Failed)
    assert "engine failed" in str(mine["ok"][1].error)
    (refusal,) = mine["long"]
    assert isinstance(refusal, Failed) and refusal.error.status == 400
    assert "engine failed" not in str(refusal.error)


def test_stop_sends_what_the_pass_decided() -> None:
    loop = EngineLoop(EngineArgs.from_kwargs(None, max_model_len=512, torch_threads=1), 64)
    loop.start()
    out = Recorder()
    gate = _held(loop)
    loop.submit(Submission("r", [5, 6, 7], SamplingParams(max_tokens=4), Sink(out, "r")))
    loop.stop(timeout=0.01)  # "stop" queued behind the submission (the thread is held)
    gate.set()
    loop.stop()  # joins the thread, which stopped at the first "stop"
    assert [type(e) for _, e in out.events()] == [Started]
