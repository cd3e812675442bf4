"""Reading hybrid configurations and folders: Mamba geometry and cache layers from config.json,
Granite's layer-type spellings, and a clear ValueError for everything kvtier cannot load."""

from __future__ import annotations

import json

import pytest

from kvtier.config import MambaShape
from kvtier.model.arch import arch_spec
from kvtier.model.hf_config import load_model_config, model_config_from_dict
from kvtier.model.hybrid_loader import load_hybrid
from kvtier.model.testing import tiny_hybrid_config, write_tiny_model


def test_falcon_h1_preset_has_a_mamba_mixer_beside_every_attention_layer():
    model = load_model_config("falcon-h1-0.5b")
    assert model.layer_kinds == ("full",) * 36 and model.parallel_mamba
    assert model.mamba == MambaShape(
        num_heads=24, head_dim=64, state_size=128, num_groups=1, conv_kernel=4
    )
    assert model.mamba.conv_dim == 1536 + 2 * 128
    assert model.mamba.state_elems == 1792 * 3 + 24 * 64 * 128
    layers = model.cache_layers()
    assert layers[:2] == ((0, "full"), (1, "full")) and layers[36:38] == (
        (0, "mamba"),
        (1, "mamba"),
    )


@pytest.mark.parametrize(
    ("types", "kinds"),
    [
        (["mamba", "attention"], ("mamba", "full")),  # what Granite 4.0 checkpoints write
        (["linear_attention", "full_attention"], ("mamba", "full")),  # transformers v5 spelling
    ],
)
def test_granite_layer_types_in_either_spelling(types, kinds):
    cfg = tiny_hybrid_config("granite_hybrid", num_hidden_layers=2, layer_types=types)
    model = model_config_from_dict(cfg)
    assert model.layer_kinds == kinds and not model.parallel_mamba
    assert model.mamba is not None and model.mamba.intermediate_size == 128


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layer_types": ["mamba", "attention", "moe", "mamba"]}, "unknown layer type 'moe'"),
        ({"mamba_d_head": 12}, r"mamba_n_heads 8 × mamba_d_head 12 != the Mamba inner width 128"),
        ({"mamba_n_groups": 3}, "must be a multiple of mamba_n_groups"),
    ],
)
def test_bad_hybrid_configs_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_dict(tiny_hybrid_config("granite_hybrid", **changes))


def test_the_plain_decoder_points_hybrids_to_their_loader(tiny_model_dir):
    config = load_model_config(tiny_model_dir("falcon_h1"))
    with pytest.raises(ValueError, match=r"load it with kvtier\.model\.hybrid_loader\.load_hybrid"):
        arch_spec(config)
    with pytest.raises(ValueError, match="not a supported Mamba2 hybrid"):
        load_hybrid(tiny_model_dir("llama"))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' unsupported for hybrids; use silu"),
        ({"num_local_experts": 0}, r"missing \[\]|unexpected \['model.layers.0.moe"),
        ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers 5"),
    ],
)
def test_unsupported_or_mismatched_folders(tiny_model_dir, tmp_path, changes, match):
    arch = "falcon_h1" if "ssm_multipliers" in changes else "granite_hybrid"
    folder = write_tiny_model(tmp_path, arch)
    cfg = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_hybrid(folder)


def test_a_falcon_h1_folder_may_name_sliding_window_layers(tmp_path) -> None:
    """A kvtier toy beyond transformers' Falcon-H1: `layer_types` with sliding-window attention
    (the garble benchmark's hybrid with window and state groups)."""
    from kvtier.model.hf_config import load_model_config
    from kvtier.model.testing import write_tiny_model

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    folder = write_tiny_model(tmp_path, "falcon_h1", layer_types=types, sliding_window=16)
    cfg = load_model_config(folder)
    assert cfg.layer_kinds == ("sliding", "full", "sliding") and cfg.sliding_window == 16
    assert [k for _, k in cfg.cache_layers()].count("mamba") == 3
