"""A step's layers as one native call each (model/fused_layer.py, kernels/csrc/layer.c) give the bits of
the layers' Python path on the same plans, on every architecture's layer shape, for decodes,
drafts and prompts' chunks (planned for the attention kernel when the step runs fused); batches
they do not serve (too many rows for the tiles, float32, the torch-only model) take the Python
path; a weight replaced after the first step is used, not the one the call was first built on."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import fused_layer, layers, native
from kvtier.model.fused_layer import FusedLayers
from kvtier.model.loader import load_model
from kvtier.model.testing import ARCHITECTURES
from tests.model.paged import PagedKV, record_fused_runs

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.tile_linear, reason="no tile linear here"
)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    return record_fused_runs(monkeypatch)


def python_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer on its Python path from now on, over the plans the fused steps had (a step
    that can run fused plans its prompts' chunks for the attention kernel)."""
    monkeypatch.setattr(FusedLayers, "run", lambda self, *args, **kwargs: None)


def decode(model, steps: int, seqs: int = 5, block_size: int = 8) -> list[torch.Tensor]:
    """Logits of a prefill of `seqs` prompts, then `steps` decode steps; every fifth step one
    sequence brings three tokens (a draft verification: a short multi-query)."""
    kv = PagedKV(model, num_blocks=40 * seqs + 100, block_size=block_size)
    prompts = {f"s{i}": list(range(3 + i, 20 + 3 * i)) for i in range(seqs)}
    out = kv.step(list(prompts.items()))
    for t in range(steps):
        batch = [
            (s, [5 + t + j] if j != t % 5 else [5 + t, 6 + t, 7]) for j, s in enumerate(prompts)
        ]
        out += kv.step(batch)
    return out


def assert_fused_bits(model, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """Every step of `decode` in one call a layer (the prompts' chunks too), with the bits of the
    same steps on the layers' Python path."""
    served = record_fused_runs(monkeypatch)
    fused = decode(model, steps=steps)
    assert all(served), served
    python_layers(monkeypatch)
    python = decode(model, steps=steps)
    for a, b in zip(fused, python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_same_bits_as_the_python_layers(tiny_model_dir, arch, monkeypatch):
    model = load_model(tiny_model_dir(arch), dtype="bfloat16")
    assert_fused_bits(model, monkeypatch, steps=30)  # past the sliding windows (mistral, gemma)


def test_batches_it_does_not_serve_take_the_python_path(tiny_model_dir, served, monkeypatch):
    model = load_model(tiny_model_dir("llama"), dtype="bfloat16")
    assert kernels is not None and kernels.tile_linear is not None
    # at most 64 rows, as for weights above 2M elements (on AVX2 the tiles take any row count:
    # the bound of the AVX-512 paths stands in for it)
    monkeypatch.setattr(layers, "SMALL_WEIGHT", 0)
    monkeypatch.setattr(fused_layer, "takes_tiles", lambda rows, numel, kind: rows <= 64)
    decode(model, steps=1, seqs=65)  # 65 rows: more than the tiles take (`takes_tiles`)
    assert served == [False, False]
    served.clear()
    decode(model, steps=1, seqs=4)  # a prefill of 4 prompts: more than 64 rows
    assert served == [False, True]  # its first chunks on their own keys (SDPA), the decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_and_the_torch_only_model_never_fuse(tiny_model_dir, served, dtype):
    native_model = dtype == "float32"
    model = load_model(tiny_model_dir("llama"), dtype=dtype, native=native_model)
    decode(model, steps=2)
    assert not any(served)


def assert_fused_steps_match_python(model, served: list[bool], monkeypatch) -> None:
    """Three decode steps run fused, with the Python path's bits."""
    fused = decode(model, steps=3)
    assert all(served[-4:])
    python_layers(monkeypatch)
    for a, b in zip(fused, decode(model, steps=3), strict=True):
        assert torch.equal(a, b)


def test_a_parameter_assigned_anew_is_used(tiny_model_dir, served, monkeypatch):
    """Only a new `Parameter` assigned (every other weight as it was): the layers' structs are
    rebuilt on the new tensor, not left on the old parameter object's storage."""
    model = load_model(tiny_model_dir("llama"), dtype="bfloat16")
    decode(model, steps=2)
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 2, requires_grad=False)
    assert_fused_steps_match_python(model, served, monkeypatch)


def test_a_replaced_weight_is_used(tiny_model_dir, served, monkeypatch):
    model = load_model(tiny_model_dir("gemma3"), dtype="bfloat16")
    decode(model, steps=2)
    mlp = model.model.layers[1].mlp.down_proj
    mlp.weight.data = mlp.weight.detach() * 2  # another tensor, as loading or `.to()` gives
    norm = model.model.layers[0].self_attn.k_norm
    assert norm is not None
    norm.weight.data = norm.weight.detach() + 1
    post = model.model.layers[2].post_attention_layernorm  # assigned, as load_state_dict(assign)
    post.weight = torch.nn.Parameter(post.weight.detach() * 3, requires_grad=False)
    assert_fused_steps_match_python(model, served, monkeypatch)


@pytest.mark.parametrize("isa", ["skylake-avx512", "cascadelake"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_builds_without_bf16_run_bfloat16_layers_in_one_call(
    isa_build, isa, arch, tiny_model_dir, monkeypatch
):
    """AVX-512 without BF16 (Skylake-SP, Cascade Lake): the tile linear widened to float32
    (linear_wide_avx512.c) serves a bfloat16 layer's linears, so the layer runs in one call, with
    the Python layers' bits on the same build."""
    built = isa_build(isa)
    assert built.tile_linear == "avx512"
    monkeypatch.setattr(native, "kernels", lambda: built)
    assert_fused_bits(load_model(tiny_model_dir(arch), dtype="bfloat16"), monkeypatch, steps=12)
