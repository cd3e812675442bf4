"""A request whose grammar is compiling waits for it off the engine thread while the others
step (architecture.md §Grammar): the compile here is a real llguidance compile held on an event
the test controls, so what the engine thread does meanwhile is seen without any timing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest

import kvtier.model.grammar as grammar_module
from kvtier.engine.params import EngineArgs, SamplingParams
from kvtier.sampling import GrammarSpec, StructuredOutputsParams
from kvtier.server import EngineLoop
from kvtier.server.events import Delta, Event, Failed, Sink, Started, Submission
from tests.server.conftest import wait_until
from tests.server.test_delivery import Recorder

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"enum": [1, 2]}},
    "required": ["n", "ok"],
}
HANG_GUARD_S = 120.0  # only a hang guard: nothing below waits on the clock to pass


class HeldCompiles:
    """Wraps the real compile: a spec whose text holds `marker` enters, says so, and waits for
    `release` before compiling."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.entered = threading.Event()
        self.release = threading.Event()
        self._real = grammar_module._compile

    def __call__(self, tokenizer: Any, spec: GrammarSpec) -> Any:
        if self.marker in spec.spec:
            self.entered.set()
            assert self.release.wait(HANG_GUARD_S), "the test never released the compile"
        return self._real(tokenizer, spec)


def started_loop(max_waiting: int = 64, fail_at_step: int | None = None, **kw: Any) -> EngineLoop:
    """An engine loop on the embedded model; a compile timeout far past the hang guard, so the
    held compile is never cut short."""
    args = EngineArgs.from_kwargs(
        None, max_model_len=512, torch_threads=1, structured_outputs_compile_timeout_s=3600.0, **kw
    )
    engine_loop = EngineLoop(args, max_waiting, fail_at_step=fail_at_step)
    engine_loop.start()
    return engine_loop


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    engine_loop = started_loop()
    yield engine_loop
    engine_loop.stop()


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], HeldCompiles]]:
    """`hold(marker)`: compiles of specs holding `marker` wait for the test's release (released
    at the end in any case, so no compile thread outlives the test waiting)."""
    made: list[HeldCompiles] = []

    def make(marker: str) -> HeldCompiles:
        held = HeldCompiles(marker)
        monkeypatch.setattr(grammar_module, "_compile", held)
        made.append(held)
        return held

    yield make
    for held in made:
        held.release.set()


def _events(out: Recorder, key: str) -> list[Event]:
    return [e for k, e in out.events() if k == key]


def _finished(out: Recorder, key: str) -> bool:
    return any(isinstance(e, Delta) and e.finish_reason is not None for e in _events(out, key))


def _submit(loop: EngineLoop, out: Recorder, key: str, params: SamplingParams) -> None:
    loop.submit(Submission(key, [5, 6, 7, 8, 9], params, Sink(out, key)))


def _submit_held(
    loop: EngineLoop, out: Recorder, held: HeldCompiles, key: str, params: SamplingParams
) -> None:
    """Submit `key` and wait until its grammar's compile is held."""
    _submit(loop, out, key, params)
    assert held.entered.wait(HANG_GUARD_S)


def test_other_requests_step_to_the_end_while_a_grammar_compiles(
    loop: EngineLoop, hold: Callable[[str], HeldCompiles]
) -> None:
    held = hold('"maximum": 99')
    out = Recorder()
    so = StructuredOutputsParams(json=SCHEMA)
    try:
        _submit_held(
            loop, out, held, "g", SamplingParams(max_tokens=64, structured_outputs=so, seed=3)
        )
        _submit(loop, out, "free", SamplingParams(max_tokens=16, ignore_eos=True))
        wait_until(lambda: _finished(out, "free"), HANG_GUARD_S)
        # its grammar still compiling: not admitted, nothing sent
        assert _events(out, "g") == []
        assert loop.call(lambda engine: engine.num_unfinished_requests()) == 0
    finally:
        held.release.set()
    wait_until(lambda: _finished(out, "g"), HANG_GUARD_S)
    mine = _events(out, "g")
    assert isinstance(mine[0], Started)
    text = "".join(e.text for e in mine if isinstance(e, Delta))
    assert mine[-1].finish_reason == "stop"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_spec_that_fails_to_compile_off_the_engine_thread_is_a_400(
    loop: EngineLoop, hold: Callable[[str], HeldCompiles]
) -> None:
    held = hold("[unclosed")
    out = Recorder()
    bad = StructuredOutputsParams(regex="[unclosed")
    try:
        _submit_held(loop, out, held, "bad", SamplingParams(max_tokens=8, structured_outputs=bad))
        _submit(loop, out, "free", SamplingParams(max_tokens=4, ignore_eos=True))
        wait_until(lambda: _finished(out, "free"), HANG_GUARD_S)
    finally:
        held.release.set()
    wait_until(lambda: bool(_events(out, "bad")), HANG_GUARD_S)
    (refusal,) = _events(out, "bad")
    assert isinstance(refusal, Failed) and refusal.error.status == 400
    assert "regex" in str(refusal.error) and "does not compile" in str(refusal.error)
    # remembered: the same spec again is refused at once, with no second compile
    _submit(loop, out, "again", SamplingParams(max_tokens=8, structured_outputs=bad))
    wait_until(lambda: bool(_events(out, "again")), HANG_GUARD_S)
    (again,) = _events(out, "again")
    assert isinstance(again, Failed) and again.error.status == 400


def test_an_abort_while_the_grammar_compiles_drops_the_request_and_its_hold(
    loop: EngineLoop, hold: Callable[[str], HeldCompiles]
) -> None:
    held = hold('"maximum": 99')
    out = Recorder()
    so = StructuredOutputsParams(json=SCHEMA)
    try:
        _submit_held(loop, out, held, "g", SamplingParams(max_tokens=8, structured_outputs=so))
        loop.abort("g")
        assert loop.call(lambda engine: engine.grammars.num_held) == 0
    finally:
        held.release.set()
    # the compile finishes into the cache; the dropped request is never admitted
    wait_until(lambda: loop.call(lambda engine: engine.grammars.num_cached) == 1, HANG_GUARD_S)
    _submit(loop, out, "free", SamplingParams(max_tokens=4, ignore_eos=True))
    wait_until(lambda: _finished(out, "free"), HANG_GUARD_S)
    assert _events(out, "g") == []
    assert loop.call(lambda engine: engine.stats().is_idle)


def test_an_engine_failure_answers_a_request_whose_grammar_compiles(
    hold: Callable[[str], HeldCompiles],
) -> None:
    held = hold('"maximum": 99')
    loop = started_loop(fail_at_step=1)
    out = Recorder()
    so = StructuredOutputsParams(json=SCHEMA)
    try:
        _submit_held(loop, out, held, "g", SamplingParams(max_tokens=8, structured_outputs=so))
        _submit(loop, out, "free", SamplingParams(max_tokens=4))  # its first step fails
        wait_until(lambda: bool(_events(out, "g")), HANG_GUARD_S)
    finally:
        held.release.set()
        loop.stop()
    assert loop.error is not None
    (failed,) = _events(out, "g")
    assert isinstance(failed, Failed) and "engine failed" in str(failed.error)


def test_requests_waiting_for_their_grammar_count_in_the_backlog(
    hold: Callable[[str], HeldCompiles],
) -> None:
    held = hold('"maximum": 99')
    loop = started_loop(1, max_num_seqs=1)  # one request may wait beyond the one running slot
    out = Recorder()
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    try:
        for key in ("a", "b", "c"):  # a fills the slot, b waits, c is one too many
            _submit(loop, out, key, params)
        assert held.entered.wait(HANG_GUARD_S)
        wait_until(lambda: bool(_events(out, "c")), HANG_GUARD_S)
        (busy,) = _events(out, "c")
        assert isinstance(busy, Failed) and busy.error.status == 429
        held.release.set()
        wait_until(lambda: _finished(out, "a") and _finished(out, "b"), HANG_GUARD_S)
    finally:
        held.release.set()
        loop.stop()
