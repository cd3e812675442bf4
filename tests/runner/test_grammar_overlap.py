"""A step's grammar masks are filled while the model's forward runs, not after it: the fill and
the forward each wait to see the other started, which only completes when they overlap (run one
after the other, the first waits out its hang guard and the step fails)."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

from kvtier.engine import LLM, SamplingParams, StructuredOutputsParams
from kvtier.runner.sampling import Planned, StepSampler

HANG_GUARD_S = 60.0
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}


@pytest.mark.parametrize("depth", [1, 2])
def test_masks_are_filled_while_the_forward_runs(
    depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(None, max_model_len=128, async_scheduling=depth > 1, async_depth=depth)
    model = llm.engine.runner.model
    # the fill and the forward of a step with grammar rows both wait here for the other
    meet = threading.Barrier(2, timeout=HANG_GUARD_S)
    expect = [False]  # this step has grammar rows: its forward meets the fill
    num_met = [0]
    real_start, real_fill = StepSampler.start_masks, StepSampler.fill_masks
    real_forward = model.forward

    def start(self: StepSampler, plan: list[Planned]) -> Any:
        expect[0] = any(p.samples and p.state.grammar is not None for p in plan)
        return real_start(self, plan)

    def fill(self: StepSampler, plan: list[Planned]) -> Any:
        meet.wait()
        return real_fill(self, plan)

    def forward(*args: Any) -> Any:
        if expect[0]:
            meet.wait()
            num_met[0] += 1
        return real_forward(*args)

    monkeypatch.setattr(StepSampler, "start_masks", start)
    monkeypatch.setattr(StepSampler, "fill_masks", fill)
    monkeypatch.setattr(model, "forward", forward)
    so = StructuredOutputsParams(json=SCHEMA)
    try:
        (out,) = llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}],
            SamplingParams(max_tokens=32, structured_outputs=so),
            use_tqdm=False,
        )
    finally:
        llm.engine.close()
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert num_met[0] >= 2  # the request took several steps, each met
