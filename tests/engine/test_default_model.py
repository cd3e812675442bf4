"""The embedded default model: `LLM()` loads it offline, `kvtier generate` streams from it, and its
continuations depend on the prompt (so corrupted KV would show in the text)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.params import DEFAULT_MODEL

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def test_default_model_is_a_small_hybrid_gemma3(llm: LLM) -> None:
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert set(cfg.layer_kinds) == {"sliding", "full"}
    size = sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir())
    assert size < 20 * 2**20


def test_continuations_depend_on_the_prompt(llm: LLM) -> None:
    prompts = ["The with statement", "A class definition defines", "The for loop", "Lambda"]
    texts = [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert all(len(t) > 10 for t in texts)
    assert len(set(texts)) == len(texts)


def test_kvtier_generate_prints_the_continuation() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "generate",
            "--max-tokens",
            "16",
            "The with statement",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (
        r.stdout.startswith("The with statement") and len(r.stdout) > len("The with statement") + 10
    )
    assert "tokens/s" in r.stderr
