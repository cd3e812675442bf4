"""An 8-bit KV cache's scales from the checkpoint (model/kv_scales.py, docs/kernels.md "8-bit KV"):
per-layer k/v scales under every name llm-compressor and ModelOpt write reach the cache — a model
whose K/V are 256× larger (the same function: q and o scaled down to match) gives, with its
calibrated scales, the logits the original gives with its own, and without them saturates — and a
scheme or tensor kvtier cannot serve is a ValueError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.model import native
from kvtier.model.loader import load_model
from kvtier.model.paged import FP8
from kvtier.model.quant import Int8Linear
from kvtier.model.served import load_served
from kvtier.model.testing import (
    FP8_KV_SCHEME,
    KV_SCALE_NAMES,
    write_int8_model,
    write_kv_scaled_model,
)
from tests.model.paged import PagedKV, record_fused_runs

E4M3 = torch.float8_e4m3fn
TOKENS = list(range(10, 60))
PROMPT = 20
GROW = 256.0  # a power of two: the grown model's products are the original's, exactly shifted
kernels = native.kernels()
FUSED = kernels is not None and bool(kernels.tile_linear)  # the one-call layer runs


def logits_and_caches(folder: Path, kv_dtype: torch.dtype | None, fused: bool = True):
    """Teacher-forced logits (a 20-token prefill, then one token a step) and the KV pool after."""
    model = load_model(folder, dtype="bfloat16")
    kv = PagedKV(model, num_blocks=64, block_size=4, kv_dtype=kv_dtype)
    steps = [kv.step([("s", TOKENS[:PROMPT])])[0]]
    steps += [kv.step([("s", [t])])[0] for t in TOKENS[PROMPT:]]
    return torch.cat(steps).double(), kv.kv_caches


def grown(source: Path, folder: Path, factor: float) -> Path:
    """`source` with K and V `factor` times larger and q and o `factor` times smaller: the same
    function (scores q·k and o(v) unchanged), K/V past fp8's range."""
    folder.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    for name in tensors:
        for proj, by in (("k_proj", factor), ("v_proj", factor), ("q_proj", 1 / factor)):
            if f".{proj}." in name:
                tensors[name] = tensors[name] * by
        if ".o_proj." in name:
            tensors[name] = tensors[name] / factor
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def calibrated(caches: list[torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Static per-tensor scales as a min-max observer sets them: each layer's |K|, |V| max over
    the largest e4m3 value."""
    top = FP8[E4M3]
    return {i: (c[:, 0].abs().max().item() / top, c[:, 1].abs().max().item() / top)
            for i, c in enumerate(caches)}  # fmt: skip


@pytest.mark.parametrize("config", [{}, {"hidden_size": 256}], ids=["head16", "head64"])
def test_checkpoint_scales_reach_the_fp8_cache(tiny_model_dir, tmp_path, monkeypatch, config):
    """At head size 64 the one-call layer kernel (layer.c) runs where it is built: it takes the
    checkpoint's scales as the Python layers do."""
    runs = record_fused_runs(monkeypatch)
    source = tiny_model_dir("llama", **config)
    big = grown(source, tmp_path / "big", GROW)
    plain, plain_caches = logits_and_caches(big, None)
    assert plain_caches[0][:, 0].abs().max() > 2 * FP8[E4M3]  # K beyond e4m3's range
    scales = calibrated(plain_caches)
    assert len({s for pair in scales.values() for s in pair}) >= 6  # each layer its own
    big_scaled = write_kv_scaled_model(big, tmp_path / "big-scaled", scales)
    small = {i: (k / GROW, v / GROW) for i, (k, v) in scales.items()}
    small_scaled = write_kv_scaled_model(source, tmp_path / "small-scaled", small)
    runs.clear()
    ours, caches = logits_and_caches(big_scaled, E4M3)
    if config and FUSED:
        assert runs and all(runs)
    same, same_caches = logits_and_caches(small_scaled, E4M3)
    # the same codes in the cache and the same logits as the original with its scales
    for a, b in zip(caches, same_caches, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(ours, same, rtol=0, atol=1e-9)
    unscaled, _ = logits_and_caches(big, E4M3)  # scale 1.0: K/V saturate at ±448
    err, err_unscaled = (ours - plain).abs().mean(), (unscaled - plain).abs().mean()
    assert err * 4 < err_unscaled, (err, err_unscaled)


def test_the_engine_serves_a_checkpoints_scales(tiny_model_dir, tmp_path):
    """Through the engine (its pool, native kernels): the grown model with its scales stores the
    original's codes and samples its tokens."""
    source = tiny_model_dir("llama")
    big = grown(source, tmp_path / "big", GROW)
    scales = calibrated(logits_and_caches(big, None)[1])
    small = {i: (k / GROW, v / GROW) for i, (k, v) in scales.items()}
    runs = {}
    for name, folder in (
        ("big", write_kv_scaled_model(big, tmp_path / "big-scaled", scales)),
        ("small", write_kv_scaled_model(source, tmp_path / "small-scaled", small)),
    ):
        kw = {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "num_device_blocks": 32}
        eng = EngineCore(EngineArgs.from_kwargs(str(folder), **kw, block_size=4, max_model_len=64))
        eng.add_request("a", TOKENS[:PROMPT], SamplingParams(max_tokens=16, temperature=0))
        runs[name] = (eng.drain()["a"].token_ids, [t.clone() for t in eng.device.kv("device")])
    assert runs["big"][0] == runs["small"][0]
    for a, b in zip(runs["big"][1], runs["small"][1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("naming", list(KV_SCALE_NAMES))
def test_every_checkpoint_naming_loads_per_layer(tiny_model_dir, tmp_path, naming):
    scales = {0: (0.5, 0.25), 2: (0.125, 2.0)}
    folder = write_kv_scaled_model(tiny_model_dir("llama"), tmp_path / naming, scales, naming)
    got = load_served(folder).kv_scales()
    legacy = naming == "kv-scale"  # one scale for both
    want = {i: (k, k if legacy else v) for i, (k, v) in scales.items()}
    assert got == [want.get(i, (1.0, 1.0)) for i in range(len(got))]


def test_a_hybrids_attention_layers_take_their_scales(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("granite_hybrid")  # layer 1 is its one attention layer
    scaled = write_kv_scaled_model(folder, tmp_path / "ok", {1: (0.5, 0.25)})
    assert load_served(scaled).kv_scales() == [(0.5, 0.25)]
    mamba = write_kv_scaled_model(folder, tmp_path / "bad", {0: (0.5, 0.25)})
    with pytest.raises(ValueError, match="layer 0, which has no attention"):
        load_served(mamba)


def test_query_scales_are_dropped_and_a_kv_only_config_is_no_weight_quantization(
    tiny_model_dir, tmp_path
):
    folder = write_kv_scaled_model(tiny_model_dir("llama"), tmp_path / "q", {0: (0.5, 0.25)})
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_scale"] = torch.tensor(0.1)
    save_file(tensors, str(folder / "model.safetensors"))
    served = load_served(folder, quantization="compressed-tensors")  # nothing int8: loads
    assert served.kv_scales()[0] == (0.5, 0.25)


@pytest.mark.parametrize(
    "change",
    [
        {"strategy": "attn_head"},
        {"strategy": "channel"},
        {"num_bits": 4},
        {"type": "int"},
        {"symmetric": False},
        {"dynamic": True},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_a_kv_cache_scheme_kvtier_cannot_serve_is_refused(tiny_model_dir, tmp_path, change):
    scheme = FP8_KV_SCHEME | change
    folder = write_kv_scaled_model(
        tiny_model_dir("llama"), tmp_path / "s", {0: (0.5, 0.25)}, scheme=scheme
    )
    with pytest.raises(ValueError, match="kv_cache_scheme") as err:
        load_served(folder)
    assert "static, symmetric fp8" in str(err.value)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"k_scale": torch.full((2,), 0.5), "v_scale": torch.tensor(0.5)}, "per-head"),
        ({"k_scale": torch.tensor(0.5)}, "has a k_scale but not the other"),
        ({"k_scale": torch.tensor(-1.0), "v_scale": torch.tensor(0.5)}, "positive and finite"),
        ({"v_scale": torch.tensor(float("inf")), "k_scale": torch.tensor(1.0)}, "positive"),
    ],
    ids=["per-head", "k-only", "negative", "inf"],
)
def test_a_scale_tensor_kvtier_cannot_apply_is_refused(tiny_model_dir, tmp_path, tensors, match):
    folder = write_kv_scaled_model(tiny_model_dir("llama"), tmp_path / "t", {})
    weights = load_file(str(folder / "model.safetensors"))
    weights |= {f"model.layers.1.self_attn.{k}": v for k, v in tensors.items()}
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match) as err:
        load_served(folder)
    assert "model.layers.1" in str(err.value) or "layer 1" in str(err.value)


def test_scales_of_a_layer_the_model_lacks_are_refused(tiny_model_dir, tmp_path):
    folder = write_kv_scaled_model(tiny_model_dir("llama"), tmp_path / "t", {9: (0.5, 0.5)})
    with pytest.raises(ValueError, match="names layer 9"):
        load_served(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"


def test_int8_weights_and_kv_scales_load_together(tiny_model_dir, tmp_path):
    """llm-compressor's W8A16 recipe with a kv_cache_scheme: int8 linears and the KV scales."""
    int8 = write_int8_model(tiny_model_dir("llama"), tmp_path / "int8")
    folder = write_kv_scaled_model(int8, tmp_path / "both", {1: (0.5, 0.25)})
    served = load_served(folder)
    assert served.kv_scales()[1] == (0.5, 0.25)
    assert any(isinstance(m, Int8Linear) for m in served.module.modules())
