"""Request ids at the engine boundary: an id is in use from `add_request` until the engine hands
the request back (finished or aborted); from then on it may be used again at once, even while
steps of the request that held it are still in flight — and the two never mix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine import EngineArgs, EngineCore, SamplingParams, TransferFaults
from kvtier.model.testing import write_tiny_model

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama-ids"), "llama")


def engine(path: Path, **kw: object) -> EngineCore:
    args = {"device": "sim", "max_model_len": 64, "block_size": 4, "check_integrity": True}
    return EngineCore(EngineArgs.from_kwargs(str(path), **{**args, **kw}))


def alone(path: Path, prompt: list[int]) -> list[int]:
    e = engine(path, async_scheduling=False, enable_prefix_caching=False)
    e.add_request("alone", prompt, PARAMS)
    return e.drain()["alone"].token_ids


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_an_aborted_id_is_reusable_at_once(llama: Path, depth: int, num_steps: int) -> None:
    """Issue 41: once `abort()` returned the request, `check_request` accepted its id but
    `add_request` refused it ("already in use") while the old request's steps were in flight.
    Now both accept it, and the new request's outputs are its own."""
    e = engine(llama, async_depth=depth, num_speculative_tokens=2)
    old, new = [5, 6, 7, 8, 9, 10], [40, 41, 42, 43]
    e.add_request("r", old, PARAMS)
    for _ in range(num_steps):
        e.step()
    assert e.stats().num_steps_in_flight > 0  # the old request's steps are in flight
    aborted = e.abort("r")
    assert aborted is not None and aborted.finish_reason == "abort"
    e.check_request("r", new, PARAMS)
    e.add_request("r", new, PARAMS)
    with pytest.raises(ValueError, match="already in use"):
        e.check_request("r", new, PARAMS)  # the new one holds it now
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("r", new, PARAMS)
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert [o.req_id for o in outs] == ["r"] * len(outs)
    finished = [o.result for o in outs if o.result is not None]
    assert len(finished) == 1
    assert finished[0].prompt_token_ids == new
    assert finished[0].token_ids == alone(llama, new)
    assert [t for o in outs for t in o.new_token_ids] == finished[0].token_ids  # none of old's
    assert e.abort("r") is None  # handed out: unknown again
    e.check_integrity()
    assert e.stats().is_idle


def test_an_id_aborted_while_its_load_is_in_flight_is_reusable_at_once(llama: Path) -> None:
    """The aborted request's host load still lands (it pins blocks until then) and reports
    nothing; a new request under the same id meanwhile waits for it, loads and runs as its
    own."""
    e = engine(llama, num_device_blocks=17, num_host_blocks=64)
    prefix = list(range(50, 82))
    e.add_request("owner", prefix, PARAMS)
    e.drain()
    for i in range(2):  # evict the prefix from the device: it is on the host only
        e.add_request(f"churn{i}", list(range(100 + 40 * i, 140 + 40 * i)), PARAMS)
        e.drain()
    e.set_transfer_faults(TransferFaults(delay_polls=4))  # loads stay in flight 4 steps
    e.add_request("r", [*prefix, 7, 8], PARAMS)
    e.step()
    assert e.stats().num_pending_loads == 1
    assert e.abort("r") is not None
    waits = e.stats().host_metrics.num_load_waits  # type: ignore[union-attr]
    prompt = [*prefix, 9, 10, 11]
    e.add_request("r", prompt, PARAMS)
    done = e.drain()
    assert done["r"].token_ids == alone(llama, prompt)
    assert done["r"].num_external_cached_tokens > 0  # it loaded the prefix itself
    # ... after waiting for the old request's load of it, like any other request (under one
    # id the host tier took the old load's claim on the prefix for the new request's own)
    assert e.stats().host_metrics.num_load_waits > waits  # type: ignore[union-attr]
    e.check_integrity()
    assert e.stats().is_idle
