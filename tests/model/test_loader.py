"""Loader and tokenizer: what a HF folder provides, and a clear ValueError for each thing missing
or unsupported (naming the file or field and the fix)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from kvtier.model import native
from kvtier.model.loader import (
    empty_weights,
    load_generation_defaults,
    load_model,
    load_pretrained,
)
from kvtier.model.tokenizer import load_tokenizer


def copy_of(tiny_model_dir, tmp_path, arch="llama"):
    return shutil.copytree(tiny_model_dir(arch), tmp_path / "m")


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        load_model(tmp_path / "nope")


def test_missing_config(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        load_model(folder)


def test_missing_weights_mentions_bin_files(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*safe_serialization"):
        load_model(folder)


def test_missing_shard(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        load_model(folder)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"architectures": ["FalconForCausalLM"]}, "not supported"),
        ({"architectures": ["Llama4ForCausalLM"]}, "not supported by kvtier.model"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"hidden_act": "relu2"}, "activation 'relu2'"),
    ],
)
def test_unsupported_settings(tiny_model_dir, tmp_path, changes, match):
    folder = copy_of(tiny_model_dir, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_weights_of_another_architecture(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path, "qwen2")  # has q/k/v biases, tied head
    edit_config(folder, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="weights do not match LlamaForCausalLM"):
        load_model(folder)


def test_unsupported_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match="dtype 'int8' unsupported"):
        load_model(tiny_model_dir("llama"), dtype="int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_dtypes_and_tied_embeddings(tiny_model_dir, dtype):
    tied = load_model(tiny_model_dir("gemma3"), dtype=dtype)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.dtype == getattr(torch, dtype)
    untied = load_model(tiny_model_dir("llama"), dtype=dtype)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_tokenizer_and_generation_config(tiny_model_dir):
    folder = tiny_model_dir("llama")
    tok = load_tokenizer(folder)
    ids = tok.encode("héllo, wörld")
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids) == "héllo, wörld"
    assert tok.eos_token_ids == (2,)
    assert load_generation_defaults(folder).eos_token_ids == (2,)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<bos><user>hi\n<assistant>"


def test_missing_tokenizer(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer\.json is missing.*prompt_token_ids"):
        load_tokenizer(folder)
    assert load_model(folder) is not None  # the model itself loads without a tokenizer


def test_missing_chat_template(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_load_pretrained_bundles_model_tokenizer_and_defaults(tiny_model_dir, tmp_path):
    bundle = load_pretrained(tiny_model_dir("gemma2"), dtype="bfloat16")
    assert bundle.model.config.architecture == "Gemma2ForCausalLM"
    assert bundle.tokenizer is not None and bundle.tokenizer.eos_token_ids == (2,)
    assert bundle.generation.eos_token_ids == (2,)
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    assert load_pretrained(folder).tokenizer is None


def test_empty_weights_builds_on_meta_without_fills_and_restores_them() -> None:
    fills = {name: getattr(torch.nn.init, name) for name in ("normal_", "kaiming_uniform_")}
    with pytest.raises(RuntimeError, match="inside"), empty_weights():
        layer = torch.nn.Linear(4, 4)
        assert layer.weight.is_meta
        raise RuntimeError("inside")
    assert {name: getattr(torch.nn.init, name) for name in fills} == fills
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_loading_a_model_does_not_import_dynamo() -> None:
    """A random fill of a meta tensor imports torch._dynamo on its first call: 1.2–1.5 s of every
    `kvtier generate` / `serve` start before `empty_weights`."""
    code = (
        "import sys; from kvtier.engine.params import DEFAULT_MODEL; "
        "from kvtier.model.loader import load_model; load_model(DEFAULT_MODEL); "
        "sys.exit('torch._dynamo' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _assert_logged(folder, built, monkeypatch, caplog) -> None:
    monkeypatch.setattr(native, "kernels", lambda: built)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtier.model"):
        load_model(folder, dtype="bfloat16")
    assert native.describe(built) in caplog.text


def test_loading_says_where_each_kernel_family_runs(tiny_model_dir, monkeypatch, caplog):
    """The log names the library and each family's path (this CPU's build), or that torch ops
    serve where no library is built; a model loaded without the kernels says nothing of them."""
    folder = tiny_model_dir("llama")
    _assert_logged(folder, native.kernels(), monkeypatch, caplog)
    _assert_logged(folder, None, monkeypatch, caplog)
    assert "torch ops serve" in native.describe(None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtier.model"):
        load_model(folder, dtype="bfloat16", native=False)
    assert "native kernels" not in caplog.text


def test_a_build_without_bf16_says_its_linear_is_widened(
    tiny_model_dir, isa_build, monkeypatch, caplog
):
    built = isa_build("skylake-avx512")
    _assert_logged(tiny_model_dir("llama"), built, monkeypatch, caplog)
    assert "bfloat16 linear on avx512," in native.describe(built)
