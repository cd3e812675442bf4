"""What `--model` and `--dtype` accept (issue 36): a float16 checkpoint runs as bfloat16 on the cpu
backend under `auto`, as vLLM's CPU build does; a GGUF file, a file instead of a folder, or a
folder without config.json gets one clear error naming the input and what to pass instead."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.model.hf_config import load_model_config
from kvtier.model.loader import load_model, resolve_dtype
from kvtier.model.testing import write_tiny_model

ARGS = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32, "torch_threads": 1}
GGUF_HEADER = b"GGUF\x03\x00\x00\x00" + bytes(range(256))  # the magic, then binary (not UTF-8)


@pytest.fixture(scope="module")
def float16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama16"), "llama", dtype="float16")


def engine(model: str | Path, **kw: object) -> EngineCore:
    return EngineCore(EngineArgs.from_kwargs(str(model), **{**ARGS, **kw}))


def test_a_float16_checkpoint_runs_as_bfloat16_on_cpu_and_says_so(
    float16_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        eng = engine(float16_model)  # --dtype auto
    try:
        assert eng.plan.groups and eng.plan.tiers[0].num_blocks > 0
        assert {p.dtype for p in eng.model.module.parameters()} == {torch.bfloat16}
        eng.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(eng.drain()["r"].token_ids) == 4
    finally:
        eng.close()
    said = [r.getMessage() for r in caplog.records if "float16" in r.getMessage()]
    assert said and "bfloat16" in said[0] and str(float16_model) in said[0], said


def test_load_model_of_a_float16_folder_defaults_to_bfloat16(float16_model: Path) -> None:
    model = load_model(float16_model)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_auto_keeps_float16_on_cuda_and_other_dtypes_everywhere() -> None:
    assert resolve_dtype("auto", checkpoint="float16", device="cuda") is torch.float16
    assert resolve_dtype("auto", checkpoint="float16", device="sim") is torch.bfloat16
    assert resolve_dtype("auto", checkpoint="float32", device="cpu") is torch.float32
    assert resolve_dtype(None, checkpoint="bfloat16", device="cpu") is torch.bfloat16
    assert resolve_dtype("float16", device="cuda") is torch.float16


def test_float16_asked_by_name_on_cpu_names_the_flag_and_the_fix(float16_model: Path) -> None:
    with pytest.raises(ValueError, match=r"--dtype float16.*cuda.*--dtype bfloat16"):
        engine(float16_model, dtype="float16")


def test_a_gguf_file_is_refused_with_what_to_pass_instead(tmp_path: Path) -> None:
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(GGUF_HEADER)
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "generate", "--model", str(gguf), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert str(gguf) in r.stderr and "GGUF" in r.stderr and "config.json" in r.stderr
    assert "utf-8" not in r.stderr and "Traceback" not in r.stderr


def test_a_gguf_file_is_known_by_its_magic_whatever_its_name(tmp_path: Path) -> None:
    gguf = tmp_path / "weights.bin"
    gguf.write_bytes(GGUF_HEADER)
    with pytest.raises(ValueError, match=r"weights\.bin.*GGUF") as info:
        engine(gguf)
    assert "utf-8" not in str(info.value)
    with pytest.raises(ValueError, match=r"weights\.bin.*GGUF"):  # `kvtier plan --model`
        load_model_config(gguf)


def test_a_folder_of_gguf_files_names_them(tmp_path: Path) -> None:
    (tmp_path / "m.Q8_0.gguf").write_bytes(GGUF_HEADER)
    with pytest.raises(ValueError, match=r"config\.json.*m\.Q8_0\.gguf.*GGUF"):
        engine(tmp_path)


def test_a_folder_without_config_json_names_the_folder_and_the_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("weights elsewhere")
    with pytest.raises(ValueError, match=rf"{tmp_path}.*config\.json.*safetensors"):
        engine(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_a_model_folder_asks_for_the_folder(float16_model: Path, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*is a file.*pass its folder.*{float16_model}"):
        engine(float16_model / name)
