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
from kvtier.model.grammar import Grammars, MaskFill
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
    expect = [False]  # this step has rows a grammar binds: its forward meets the fill
    num_met = [0]
    real_start, real_prepare, real_fill = (
        StepSampler.start_masks,
        Grammars.prepare_masks,
        MaskFill.run,
    )
    real_forward = model.forward

    def start(self: StepSampler, plan: list[Planned]) -> Any:
        expect[0] = False
        return real_start(self, plan)

    def prepare(self: Grammars, *args: Any) -> MaskFill | None:
        fill = real_prepare(self, *args)
        expect[0] = fill is not None
        return fill

    def fill(self: MaskFill) -> Any:
        meet.wait()
        return real_fill(self)

    def forward(*args: Any) -> Any:
        if expect[0]:
            meet.wait()
            num_met[0] += 1
        return real_forward(*args)

    monkeypatch.setattr(StepSampler, "start_masks", start)
    monkeypatch.setattr(Grammars, "prepare_masks", prepare)
    monkeypatch.setattr(MaskFill, "run", fill)
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
