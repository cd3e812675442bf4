"""Int8 weights with int8 activations (W8A8, dynamic per token): the native W8A8 linear gives the
bits of its torch reference (`w8a8_reference`: exact int32 sums, then the scales) at every row
count, in this CPU's build and in the AVX2 build (x86-64-v3, linear_w8a8_avx2.c), which is the dequantized product up to the rounding of x to int8; the compressed-tensors
W8A8 folders `write_int8_model` writes load as W8A8 and run as transformers runs them (its
compressed-tensors integration quantizes the activations as it goes); the one-call layers give
the Python layers' bits; `--quantization w8a8`; what the loader refuses."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.kernels.build import cpu_flags
from kvtier.model import native
from kvtier.model.loader import load_model
from kvtier.model.quant import (
    W8A8_ACTIVATIONS,
    Int8Linear,
    quantize_int8,
    quantize_rows,
    w8a8_reference,
)
from kvtier.model.testing import write_int8_model
from tests.model.conftest import ISA_FLAGS
from tests.model.reference import hf_logits, hf_model
from tests.model.test_fused_layer import assert_fused_bits
from tests.model.test_goldens import PROMPT_LEN, generate_paged, prompt
from tests.model.test_int8 import _edit_config

kernels = native.kernels()
needs_w8a8_kernel = pytest.mark.skipif(
    kernels is None or not kernels.w8a8_linear,
    reason="no W8A8 linear kernel here (AVX512-VNNI or AVX2)",
)
ct = pytest.importorskip("compressed_tensors")  # the format's own reader (the dev extra has it)
logging.getLogger("compressed_tensors").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):
    cache: dict[tuple[object, ...], Path] = {}

    def make(arch: str, **config: object) -> Path:
        key = (arch, tuple(sorted(config.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-w8a8")
            source = tiny_model_dir(arch, **config)
            cache[key] = write_int8_model(source, out, activations=dict(W8A8_ACTIVATIONS))
        return cache[key]

    return make


@pytest.fixture(scope="module")
def int8_only(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):
    """The same weights, W8A16: the activations stay float."""

    def make(arch: str) -> Path:
        return write_int8_model(tiny_model_dir(arch), tmp_path_factory.mktemp(f"{arch}-w8a16"))

    return make


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "skylake-avx512", "cascadelake"])
def built(request: pytest.FixtureRequest, isa_build) -> native.Kernels:
    """The W8A8 kernel of this CPU's build; without AVX512-VNNI x in int16 on the W8A16 tiles
    (other tiles, the same bits): linear_w8a8_avx2.c's blocks on the AVX2 build (x86-64-v3),
    linear_i8_avx512.c's on an AVX-512 CPU without VNNI (skylake-avx512); linear_w8a8_avx512.c
    without BF16 (cascadelake: its integer store)."""
    if request.param == "native":
        if kernels is None or not kernels.w8a8_linear:
            pytest.skip("no W8A8 linear kernel in this CPU's build")
        return kernels
    got = isa_build(request.param)
    want = {"x86-64-v3": ("avx2", "avx2"), "skylake-avx512": ("avx512", "avx512")}.get(
        request.param, ("avx512vnni", "avx512")
    )
    assert (got.w8a8_linear, got.i8_linear) == want, f"the {request.param} build's int8 linears"
    return got


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, q, scale, b


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 17, 64, 70])
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(40, 70, True), (200, 96, False), (33, 1000, True), (80, 31, False)]
)
def test_the_w8a8_kernel_gives_the_reference_bits_at_every_batch(built, rows, n, k, bias) -> None:
    """Row counts through every register block of both builds; k below, across and far past one
    32-element block; more columns than one AVX2 column group."""
    x, q, scale, b = _case(rows, n, k, bias)
    out = built.linear_w8a8(x, built.pack_linear_w8a8(q), scale, n, b)
    assert torch.equal(out, w8a8_reference(x, q, scale, b))
    # a row's bits never depend on its batch
    one = built.linear_w8a8(x[-1:].contiguous(), built.pack_linear_w8a8(q), scale, n, b)
    assert torch.equal(one, out[-1:])


def test_extreme_values_keep_the_sums_exact_and_strided_rows_are_read(built) -> None:
    """Every weight and activation at its largest magnitude (-128 weights too): the int32 sums
    are exact (the VNNI kernel's unsigned offset included); a row view with a stride is read as
    its rows."""
    n, k = 48, 4000
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[::2] = 127
    scale = torch.full((n,), 0.01)
    wide = torch.full((3, 2 * k), -1.0, dtype=torch.bfloat16)
    x = wide[:, :k]
    x[1] = 1.0
    out = built.linear_w8a8(x, built.pack_linear_w8a8(q), scale, n, None)
    assert torch.equal(out, w8a8_reference(x, q, scale, None))
    assert out[0, 0].item() == pytest.approx(-127 * 127 * k * 0.01 / 127, rel=1e-2)


def test_a_nan_or_inf_row_gives_nan_outputs_and_a_zero_row_the_bias(built) -> None:
    x, q, scale, b = _case(5, 24, 70, True)
    x[1, 5] = float("nan")
    x[2] = 0.0
    x[3, 69] = float("inf")  # in the last, partial k block
    out = built.linear_w8a8(x, built.pack_linear_w8a8(q), scale, 24, b)
    assert out[[1, 3]].isnan().all() and not out[[0, 2, 4]].isnan().any()
    assert torch.equal(out[2], b)
    assert torch.equal(out[[0, 4]], w8a8_reference(x[[0, 4]], q, scale, b))


def test_the_boundary_checks_the_w8a8_linear_inputs(built) -> None:
    x, q, scale, b = _case(2, 16, 64, True)
    packed = built.pack_linear_w8a8(q)
    assert packed.dtype == torch.uint8
    with pytest.raises(ValueError, match=r"packed must be torch\.uint8"):  # W8A16 tiles: not these
        built.linear_w8a8(x, built.pack_linear_i8(q), scale, 16, b)
    with pytest.raises(ValueError, match="scales must have 16 elements"):
        built.linear_w8a8(x, packed, scale[:8], 16, b)
    wide = torch.zeros(1, 65536, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k < 65536 .* got k = 65536"):
        built.linear_w8a8(wide, packed, scale, 16, None)


def test_the_boundary_sends_a_k_of_65536_to_the_reference() -> None:
    wide = torch.zeros(1, 65536, dtype=torch.bfloat16)
    # such a linear runs on the reference instead
    lin = Int8Linear(65536, 16, bias=False, int8_activations=True)
    lin.weight.data = torch.ones(16, 65536, dtype=torch.int8)
    lin.weight_scale.data = torch.ones(16)
    assert lin(wide + 1).float().eq(65536).all()


def test_the_reference_is_the_product_of_the_dequantized_operands() -> None:
    """The reference multiplies x rounded to int8 per row by the dequantized weight: in float64
    the same, to the output's bfloat16 rounding."""
    x, q, scale, b = _case(9, 50, 300, True, seed=3)
    xq, xs = quantize_rows(x)
    assert xq.abs().max() <= 127 and torch.equal(xs, x.float().abs().amax(1) / 127)
    exact = (xq.double() * xs.double()[:, None]) @ (q.double() * scale.double()[:, None]).T
    got = w8a8_reference(x, q, scale, b).double()
    torch.testing.assert_close(got, exact + b.double(), rtol=1e-2, atol=1e-2)
    # and the activations' rounding is small next to x itself
    assert ((xq.float() * xs[:, None]) - x.float()).abs().max() <= xs.max() / 2 + 1e-6


@pytest.mark.parametrize("native_path", [True, False])
def test_a_nan_reaches_its_row_only_and_zeros_give_the_bias(native_path, monkeypatch) -> None:
    if native_path and (kernels is None or not kernels.w8a8_linear):
        pytest.skip("no W8A8 linear kernel here")
    if not native_path:  # what runs where the kernel is not built: the reference
        monkeypatch.setattr(native, "kernels", lambda: None)
    x, q, scale, b = _case(4, 24, 64, True)
    x[1, 5] = float("nan")
    x[2] = 0.0
    x[3, 0] = float("inf")
    lin = Int8Linear(64, 24, bias=True, int8_activations=True)
    lin.weight.data, lin.weight_scale.data, lin.bias.data = q, scale, b  # type: ignore[union-attr]
    out = lin(x)
    assert out[[1, 3]].isnan().all() and not out[[0, 2]].isnan().any()
    assert torch.equal(out[2], b)
    assert torch.equal(out[0], w8a8_reference(x[:1], q, scale, b)[0])


def _quantizing_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' model with each decoder linear's input rounded to int8 per token by the
    rule vLLM and kvtier use (`quantize_rows`), as a forward pre-hook."""

    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((xq.to(x.dtype) * xs.to(x.dtype)[:, None]).reshape(x.shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_float32_goldens_against_transformers(w8a8_dir, int8_only, arch):
    """Golden: transformers' model of the same int8 weights (the W8A16 folder, dequantized by
    compressed-tensors) with every decoder linear's input rounded to int8 per token as vLLM
    does: the same logits up to float32's rounding and the same greedy tokens. transformers
    running the W8A8 folder itself quantizes with compressed-tensors' scale (the largest
    magnitude over 127.5), so its logits differ from ours by its activations' other rounding:
    the greedy tokens of these random models, near ties among 256, mostly agree."""
    folder = w8a8_dir(arch)
    ours = load_model(folder, dtype=torch.float32)
    lin = ours.model.layers[0].self_attn.qkv_proj
    assert isinstance(lin, Int8Linear) and lin.int8_activations
    assert not getattr(ours.lm_head, "int8_activations", False)  # the recipe leaves the head
    prefill, decoded, tokens = generate_paged(ours, prompt(seed=1))
    logits = torch.cat([prefill, decoded[:-1]])
    golden = hf_logits(_quantizing_inputs(hf_model(int8_only(arch), torch.float32)), tokens)
    torch.testing.assert_close(logits, golden[:-1], atol=1e-3, rtol=1e-3)
    assert tokens[PROMPT_LEN:] == golden[PROMPT_LEN - 1 : -1].argmax(dim=-1).tolist()
    theirs = hf_logits(hf_model(folder, torch.float32), tokens)
    agree = torch.tensor(tokens[PROMPT_LEN:]) == theirs[PROMPT_LEN - 1 : -1].argmax(dim=-1)
    assert agree.float().mean() >= 0.75


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_the_one_call_layers_give_the_python_layers_bits(built, w8a8_dir, arch, monkeypatch):
    """Both paths on one build (on x86-64-v3 layer.c calls linear_w8a8_avx2.c's linear). The
    skylake-avx512 and cascadelake builds have no bfloat16 tile linear, and these layers need
    none: every linear of theirs is int8."""
    monkeypatch.setattr(native, "kernels", lambda: built)
    assert_fused_bits(load_model(w8a8_dir(arch), dtype="bfloat16"), monkeypatch, steps=12)


@needs_w8a8_kernel
def test_a_layer_takes_the_one_call_path_only_where_its_int8_kernel_serves_it(
    w8a8_dir, tiny_model_dir
):
    import dataclasses

    from kvtier.model.fused_layer import servable

    assert kernels is not None
    layer = load_model(w8a8_dir("qwen2"), dtype="bfloat16").model.layers[0]
    assert servable(layer, kernels)
    assert not servable(layer, dataclasses.replace(kernels, w8a8_linear=None))
    assert servable(layer, dataclasses.replace(kernels, i8_linear=None))  # W8A16's: not needed
    # a build without the bfloat16 tile linear (AVX-512 without BF16) serves layers of int8
    # linears only
    no_tiles = dataclasses.replace(kernels, tile_linear=None)
    assert servable(layer, no_tiles)
    bf16 = load_model(tiny_model_dir("qwen2"), dtype="bfloat16").model.layers[0]
    assert servable(bf16, kernels) and not servable(bf16, no_tiles)
    layer.mlp.down_proj.int8_activations = False  # one scheme a layer, as the struct says
    assert not servable(layer, kernels)


def test_the_engine_serves_a_w8a8_folder_as_the_golden_does(w8a8_dir, int8_only):
    """Greedy tokens of the engine on the folder (by its config.json, and by the flag on the
    W8A16 folder) are the golden's: transformers with vLLM's per-token rounding of each linear's
    input."""
    ids = prompt(seed=1)
    ref = _quantizing_inputs(hf_model(int8_only("qwen2"), torch.float32))
    expected = list(ids)
    for _ in range(8):
        expected.append(int(hf_logits(ref, expected)[-1].argmax()))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for folder, quantization in ((w8a8_dir("qwen2"), None), (int8_only("qwen2"), "w8a8")):
        llm = LLM(str(folder), dtype="float32", max_model_len=64, num_device_blocks=32,
                  quantization=quantization)  # fmt: skip
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == expected[len(ids) :]


def test_quantization_w8a8_quantizes_the_decoder_and_the_head_weights(tiny_model_dir, w8a8_dir):
    """`--quantization w8a8` on a float checkpoint: the decoder's linears are the W8A8 folder's,
    the LM head int8 with bfloat16 inputs (its logits are what is sampled)."""
    online = load_model(tiny_model_dir("llama"), dtype=torch.float32, quantization="w8a8")
    stored = load_model(w8a8_dir("llama"), dtype=torch.float32)
    lin = online.model.layers[0].mlp.down_proj
    assert isinstance(lin, Int8Linear) and lin.int8_activations
    assert isinstance(online.lm_head, Int8Linear) and not online.lm_head.int8_activations
    a, b = online.state_dict(), stored.state_dict()
    shared = [k for k in b if k.startswith("model.")]
    assert shared and all(torch.equal(a[k], b[k]) for k in shared)
    # --quantization int8 on the W8A8 folder keeps its scheme
    kept = load_model(w8a8_dir("llama"), dtype=torch.float32, quantization="int8")
    assert kept.model.layers[0].mlp.down_proj.int8_activations


def test_without_the_kernel_the_loader_says_w8a8_runs_in_torch_ops(w8a8_dir, monkeypatch, caplog):
    monkeypatch.setattr(native, "kernels", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kvtier.model"):
        model = load_model(w8a8_dir("qwen2"), dtype="bfloat16")
    assert "W8A8 linear kernel is not built here" in caplog.text
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    lin = model.model.layers[0].mlp.gate_up_proj
    assert torch.equal(lin(x), w8a8_reference(x, lin.weight, lin.weight_scale, lin.bias))


def test_what_the_loader_refuses_names_the_scheme(w8a8_dir, tmp_path):
    folder = w8a8_dir("qwen2")
    static = dict(W8A8_ACTIVATIONS, dynamic=False)
    with pytest.raises(ValueError, match=r"input_activations is .*'dynamic': False.*per token"):
        load_model(_edit_config(folder, tmp_path / "a", input_activations=static))
    per_tensor = dict(W8A8_ACTIVATIONS, strategy="tensor")
    with pytest.raises(ValueError, match=r"input_activations is .*'tensor'"):
        load_model(_edit_config(folder, tmp_path / "b", input_activations=per_tensor))
    mixed = _edit_config(folder, tmp_path / "c")
    cfg = json.loads((mixed / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"] = dict(groups["group_0"], input_activations=None, targets=["re:.*down"])
    (mixed / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mix int8 and unquantized activations"):
        load_model(mixed)


def test_each_build_runs_its_w8a8_kernel(built, request: pytest.FixtureRequest) -> None:
    """VPDPBUSD's tiles hold w + 128 (a zero weight packs as 128), the AVX2 path's the int8
    values: AVX512-VNNI builds run linear_w8a8_avx512.c, BF16 or not (cascadelake), the others
    linear_w8a8_avx2.c."""
    isa = request.node.callspec.params["built"]
    flags = cpu_flags() if isa == "native" else ISA_FLAGS[isa]
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    packed = built.pack_linear_w8a8(torch.zeros(16, 32, dtype=torch.int8))
    assert packed.unique().tolist() == ([128] if vnni else [0])
