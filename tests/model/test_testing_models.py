"""The tiny model builder: every architecture loads, and continuations depend on the prompt."""

from __future__ import annotations

import pytest

from kvtier.model.loader import load_model
from kvtier.model.testing import ARCHITECTURES, tiny_config
from tests.model.paged import PagedKV


def greedy(model, prompt: list[int], steps: int = 12) -> list[int]:
    kv = PagedKV(model, num_blocks=32, block_size=4)
    last, out = kv.step([("s", prompt)])[0][-1], []
    for _ in range(steps):
        out.append(int(last.argmax()))
        last = kv.step([("s", [out[-1]])])[0][0]
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_continuations_depend_on_the_prompt(tiny_model_dir, arch):
    model = load_model(tiny_model_dir(arch))
    outs = [greedy(model, [1, *range(10 + 9 * i, 22 + 9 * i)]) for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    assert all(len(set(o)) >= 3 for o in outs)


def test_unknown_architecture():
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        tiny_config("falcon")
