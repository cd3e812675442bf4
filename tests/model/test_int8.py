"""Int8 weights (W8A16): the native int8 linear against float64, its torch fallback, the
compressed-tensors folders `write_int8_model` writes (read back by compressed-tensors itself),
goldens against `transformers`' dequantized model (compressed-tensors decompresses the same
folder into its float linears), the one-call layers on int8 weights, `--quantization int8` and
what the loader refuses."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import LLM, SamplingParams
from kvtier.model import native
from kvtier.model.loader import load_model
from kvtier.model.quant import Int8Linear, dequantize, pack_int8, quantize_int8, unpack_int8
from kvtier.model.testing import write_int8_model
from tests.model.int8_reference import linear_i8_bits
from tests.model.paged import PagedKV, record_fused_runs
from tests.model.reference import hf_logits, hf_model
from tests.model.test_fused_layer import assert_fused_bits
from tests.model.test_goldens import PROMPT_LEN, generate_paged, prompt

kernels = native.kernels()
needs_int8_kernel = pytest.mark.skipif(
    kernels is None or not kernels.i8_linear,
    reason="no int8 linear kernel here (AVX512-VNNI or AVX2)",
)
ct = pytest.importorskip("compressed_tensors")  # the format's own reader (the dev extra has it)
logging.getLogger("compressed_tensors").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):
    cache: dict[tuple[object, ...], Path] = {}

    def make(arch: str, fmt: str = "int-quantized", lm_head: bool = False, **config) -> Path:
        key = (arch, fmt, lm_head, tuple(sorted(config.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-int8")
            cache[key] = write_int8_model(tiny_model_dir(arch, **config), out, fmt, lm_head)
        return cache[key]

    return make


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 70])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 70, True), (200, 96, False), (33, 1000, True)])
def test_the_int8_linear_is_the_dequantized_product(rows: int, n: int, k: int, bias: bool) -> None:
    """Both paths (x in int16 blocks: ≤ 4 rows, ≤ 16 without AMX; more: the weights widened to
    bfloat16) against float64: the error is the bfloat16 output's rounding, float32 sums, and
    x's int16 rounding (at most 2^-15 of its block's largest magnitude)."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows * n)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = kernels.linear_i8(x, kernels.pack_linear_i8(q), scale, n, b)
    w = q.double() * scale.double()[:, None]
    ref = x.double() @ w.T + (0 if b is None else b.double())
    blocks = F.pad(x.double().abs(), (0, -k % 32)).view(rows, -1, 32).amax(-1)
    block_max = blocks.repeat_interleave(32, dim=1)[:, :k]  # [rows, k]: x's block's largest
    bound = 2**-8 * ref.abs() + 1e-6 * (x.double().abs() @ w.abs().T)
    bound += 2**-15 * (block_max @ w.abs().T)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert ((out.double() - ref).abs() <= bound).all()


def int16_block_rows() -> int:
    """The most rows the int8 linear runs on x's int16 blocks here: 4 with AMX (then its tiles),
    16 with AVX512-BF16 only (then widened weights), every row count on AVX2 (linear.c)."""
    assert kernels is not None
    return {"amx": 4, "avx512bf16": 16}.get(kernels.tile_linear or "", 1 << 30)


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 70])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 70, True), (200, 96, False), (72, 1000, True)])
def test_the_int16_blocks_give_the_reference_bits_at_every_batch(rows, n, k, bias) -> None:
    """Where x runs in int16 blocks (every row count on AVX2; a few rows on AVX-512) the kernel's
    bits are the in-order reference's (tests/model/int8_reference.py): the AVX2 and VNNI paths
    agree, and a row's result does not depend on the rows beside it. 72 columns at k 1000: more
    than one column group of the AVX2 path (k 1000 keeps 4 tiles a group) and a partial k block."""
    assert kernels is not None
    if rows > int16_block_rows():
        pytest.skip(f"{rows} rows run on widened weights here ({kernels.tile_linear})")
    _assert_reference_bits(kernels, rows, n, k, bias)


@pytest.mark.parametrize("isa", ["x86-64-v3", "skylake-avx512", "cascadelake"])
@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 70, True), (72, 1000, True)])
def test_builds_without_bf16_run_the_int16_blocks_at_every_batch(
    isa_build, isa, rows, n, k, bias
) -> None:
    """Without AVX512-BF16 there is no widened side: AVX2 (x86-64-v3) runs linear_i8_avx2.c,
    AVX-512 without VNNI (skylake-avx512) the AVX-512 int16 blocks by VPMADDWD + VPADDD, and with
    VNNI (cascadelake) by VPDPWSSD (both storing in integer code): the reference's bits at every
    row count, whatever this CPU builds natively."""
    built = isa_build(isa)
    want = {"x86-64-v3": "avx2", "skylake-avx512": "avx512", "cascadelake": "avx512"}[isa]
    assert built.i8_linear == want, f"the {isa} build's int8 linear: {built.i8_linear}"
    _assert_reference_bits(built, rows, n, k, bias)


def _assert_reference_bits(built: native.Kernels, rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    x[0, : k // 2] *= 1e-30  # a row with tiny and ordinary blocks side by side
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = built.linear_i8(x, built.pack_linear_i8(q), scale, n, b)
    assert torch.equal(out, linear_i8_bits(x, q, scale, b))
    alone = built.linear_i8(x[-1:].contiguous(), built.pack_linear_i8(q), scale, n, b)
    assert torch.equal(alone[0], out[-1])


@needs_int8_kernel
@pytest.mark.skipif(
    kernels is None or kernels.tile_linear != "avx512bf16", reason="the AVX512-BF16 path's claim"
)
@pytest.mark.parametrize("rows", [17, 70])
def test_above_16_rows_the_int8_linear_is_the_bf16_linear_on_the_widened_weights(rows: int):
    """Without AMX, more than 16 rows run the bfloat16 linear's blocks on the int8 weights widened
    (exactly) to bfloat16, each column's sum scaled once before the bias: with unit scales, the
    bfloat16 linear's bits on the same weights as bfloat16; 1000 columns is more than one column
    group and a k of 1000 ends in a partial k block."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows)
    n, k = 1000, 1000
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    out = kernels.linear_i8(x, kernels.pack_linear_i8(q), torch.ones(n), n, b)
    want = kernels.linear_bf16(x, kernels.pack_linear(q.bfloat16()), n, b)
    assert torch.equal(out, want)


@needs_int8_kernel
@pytest.mark.parametrize("rows", [3, 6])
def test_a_nan_in_x_reaches_its_row_only_and_zeros_give_the_bias(rows: int) -> None:
    assert kernels is not None
    q, scale = quantize_int8(torch.randn(48, 64))
    x = torch.randn(rows, 64).bfloat16()
    x[0, 37], x[1] = float("nan"), 0.0
    b = torch.randn(48).bfloat16()
    out = kernels.linear_i8(x, kernels.pack_linear_i8(q), scale, 48, b)
    assert out[0].isnan().all() and torch.equal(out[1], b) and not out[2:].isnan().any()


@needs_int8_kernel
def test_the_boundary_checks_the_int8_linear_inputs() -> None:
    assert kernels is not None
    q, scale = quantize_int8(torch.randn(32, 64))
    packed = kernels.pack_linear_i8(q)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="scales must have 32 elements"):
        kernels.linear_i8(x, packed, scale[:16], 32, None)
    with pytest.raises(ValueError, match="pack the weight with pack_linear_i8"):
        kernels.linear_i8(x, packed[:-1], scale, 32, None)
    with pytest.raises(ValueError, match=r"x must be torch\.bfloat16"):
        kernels.linear_i8(x.float(), packed, scale, 32, None)
    with pytest.raises(ValueError, match=r"weight must be torch\.int8"):
        kernels.pack_linear_i8(q.float())


def test_the_torch_path_multiplies_the_dequantized_weight() -> None:
    """float32 activations (and any CPU without the kernel) multiply q * scale, rounded once."""
    w = torch.randn(24, 40)
    q, scale = quantize_int8(w)
    assert (dequantize(q, scale, torch.float32) - w).abs().max() <= scale.max() / 2 + 1e-6
    layer = Int8Linear(40, 24, bias=True)
    layer.weight.data, layer.weight_scale.data = q, scale
    layer.bias.data = torch.randn(24)  # type: ignore[union-attr]
    x = torch.randn(5, 40)
    assert torch.equal(layer(x), F.linear(x, dequantize(q, scale, torch.float32), layer.bias))


def test_pack_quantized_is_compressed_tensors_layout() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    q = torch.randint(-127, 128, (6, 37), dtype=torch.int8)
    assert torch.equal(pack_int8(q), pack_to_int32(q, 8))
    assert torch.equal(unpack_int8(pack_to_int32(q, 8), q.shape), q)
    assert torch.equal(unpack_from_int32(pack_int8(q), 8, q.shape), q)


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_float32_goldens_against_transformers_dequantized(int8_dir, arch, fmt):
    """transformers (with compressed-tensors) decompresses the folder into float linears; ours
    runs the int8 weights: the same logits as the float goldens' bound, the same greedy tokens."""
    folder = int8_dir(arch, fmt)
    ours = load_model(folder, dtype=torch.float32)
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    prefill, decoded, tokens = generate_paged(ours, prompt(seed=1))
    expected = hf_logits(hf_model(folder, torch.float32), tokens)
    torch.testing.assert_close(prefill, expected[:PROMPT_LEN], atol=1e-4, rtol=0)
    torch.testing.assert_close(decoded[:-1], expected[PROMPT_LEN:-1], atol=1e-4, rtol=0)
    assert tokens[PROMPT_LEN:] == expected[PROMPT_LEN - 1 : -1].argmax(dim=-1).tolist()


@needs_int8_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_bfloat16_int8_is_as_accurate_as_transformers_bfloat16(int8_dir, arch, monkeypatch):
    """On the native int8 kernel, in the one-call layers: against the dequantized model in
    float64, our error is no worse than transformers' own bfloat16 run of the folder, and the
    argmax agrees as often (the bfloat16 goldens' rule)."""
    folder = int8_dir(arch, hidden_size=256)  # head 64: the attention kernel's pairs path too
    tokens = prompt(seed=2) + list(range(40, 72))
    truth = hf_logits(hf_model(folder, torch.float64), tokens)
    hf = hf_logits(hf_model(folder, torch.bfloat16), tokens).double()
    served = record_fused_runs(monkeypatch)
    kv = PagedKV(load_model(folder, dtype="bfloat16"), num_blocks=64, block_size=4)
    ours = torch.cat(
        [kv.step([("s", tokens[:PROMPT_LEN])])[0]]
        + [kv.step([("s", [t])])[0] for t in tokens[PROMPT_LEN:]]
    ).double()
    assert served and all(served[1:])  # every decode step's layers in one call
    assert (ours - truth).abs().mean() <= 1.1 * (hf - truth).abs().mean() + 1e-3
    agree = (ours.argmax(-1) == truth.argmax(-1)).float().mean()
    assert agree >= min(0.9, (hf.argmax(-1) == truth.argmax(-1)).float().mean())


@needs_int8_kernel
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_the_one_call_layers_give_the_python_layers_bits(int8_dir, arch, monkeypatch):
    assert_fused_bits(load_model(int8_dir(arch), dtype="bfloat16"), monkeypatch, steps=12)


@pytest.mark.parametrize("isa", ["skylake-avx512", "cascadelake"])
def test_builds_without_the_tile_linear_run_int8_layers_in_one_call(
    isa_build, isa, int8_dir, monkeypatch
) -> None:
    """A layer of int8 linears needs no bfloat16 tile linear: on AVX-512 without BF16, with the
    tile linear taken away, it runs in one call, with the Python layers' bits on the same
    build."""
    built = dataclasses.replace(isa_build(isa), tile_linear=None)
    assert built.i8_linear == "avx512"
    monkeypatch.setattr(native, "kernels", lambda: built)
    assert_fused_bits(load_model(int8_dir("qwen2"), dtype="bfloat16"), monkeypatch, steps=12)


def test_quantization_int8_quantizes_every_linear_as_it_loads(tiny_model_dir, int8_dir):
    """`--quantization int8` on a float checkpoint: the same weights as the compressed-tensors
    folder of it, the LM head included (here untied, quantized in the folder too), and a tied
    head gets an int8 copy while the embedding table stays float for lookups."""
    online = load_model(tiny_model_dir("llama"), dtype=torch.float32, quantization="int8")
    stored = load_model(int8_dir("llama", lm_head=True), dtype=torch.float32)
    assert isinstance(online.lm_head, Int8Linear) and isinstance(stored.lm_head, Int8Linear)
    a, b = online.state_dict(), stored.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tied = load_model(tiny_model_dir("gemma3"), dtype=torch.float32, quantization="int8")
    assert isinstance(tied.lm_head, Int8Linear)
    assert tied.model.embed_tokens.weight.dtype == torch.float32


def test_the_engine_serves_an_int8_folder_as_transformers_does(int8_dir):
    """Greedy tokens of the engine on the folder (by its config.json, and by the flag) are
    transformers' on its dequantized model."""
    folder = int8_dir("qwen2")
    ids = [1, 5, 9, 40, 77]
    ref = hf_model(folder, torch.float32)
    expected = list(ids)
    for _ in range(8):
        expected.append(int(hf_logits(ref, expected)[-1].argmax()))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for quantization in (None, "compressed-tensors"):
        llm = LLM(str(folder), dtype="float32", max_model_len=64, num_device_blocks=32,
                  quantization=quantization)  # fmt: skip
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == expected[len(ids) :]


def _edit_config(folder: Path, dst: Path, **group: object) -> Path:
    dst.mkdir()
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"].update(group)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_without_the_kernel_the_loader_says_int8_weights_dequantize_every_call(
    int8_dir, monkeypatch, caplog
):
    """bfloat16 activations would take the int8 kernel: its absence is said; float32 ones take
    torch ops anyway, so nothing is."""
    monkeypatch.setattr(native, "kernels", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kvtier.model"):
        load_model(int8_dir("qwen2"), dtype="float32")
        assert "kernel is not built here" not in caplog.text
        load_model(int8_dir("qwen2"), dtype="bfloat16")
    assert "the int8 linear kernel is not built here" in caplog.text
    assert "dequantize their weights on every call" in caplog.text
    assert "W8A8" not in caplog.text


def test_what_the_loader_refuses_names_the_fix(tiny_model_dir, int8_dir, tmp_path):
    folder = int8_dir("qwen2")  # W8A8's refusals: tests/model/test_w8a8.py
    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    with pytest.raises(ValueError, match="kvtier runs int8 symmetric channel-wise"):
        load_model(_edit_config(folder, tmp_path / "b", weights=int4))
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        load_model(tiny_model_dir("qwen2"), quantization="compressed-tensors")
    with pytest.raises(ValueError, match=r"--quantization.*'gptq' is not supported"):
        load_model(tiny_model_dir("qwen2"), quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization \(--quantization\) must be one of"):
        LLM(str(folder), quantization="awq")
