"""The HF `config.json` reader: a model folder, a `config.json` or a bundled preset to the
`ModelConfig` every layer plans with. Which layers of a family slide, chunk or run a Mamba2 mixer
is known here; what the decoder needs beyond that is read by `arch.py` and `hybrid_arch.py` from
the same dict (`ModelConfig.hf_config`). Torch-free: `kvtier plan` reads models through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.config import MambaShape, ModelConfig

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"

_HF_LAYER_TYPES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "mamba": "mamba",
}
_GRANITE_LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba"}
_GRANITE_LAYER_TYPES |= {"attention": "full", "full_attention": "full"}


def load_model_config(model: str | Path) -> ModelConfig:
    """Load from a local HF folder, a `config.json` path, or a bundled preset name."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and (PRESETS_DIR / f"{model}.json").exists():
        path = PRESETS_DIR / f"{model}.json"
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
        raise ValueError(
            f"model {str(model)!r}: no config.json there; pass a local HF model folder, a "
            f"config.json file, or one of the bundled presets: {presets}"
        )
    try:
        cfg = json.loads(path.read_text())
    except UnicodeDecodeError:  # a binary file: a GGUF checkpoint is the usual one
        what = "a binary file, not a config.json"
        if path.read_bytes()[:4] == b"GGUF":
            what = "a GGUF file (llama.cpp's format), which kvtier does not load"
        raise ValueError(
            f"model {str(model)!r}: {path} is {what}; pass the folder of a HF checkpoint "
            "(config.json, *.safetensors, tokenizer.json) or its config.json"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return model_config_from_dict(cfg, source=str(model))


def model_config_from_dict(cfg: dict[str, Any], source: str = "<dict>") -> ModelConfig:
    """Read a HuggingFace `config.json` dict (Llama, Qwen2, Mistral, Gemma2, Gemma3 text,
    Falcon-H1, Granite 4.0 hybrid)."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "")]
    arch = str(archs[0])
    try:
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"{source}: config.json lacks {exc.args[0]!r}") from None
    kinds = _layer_kinds(arch, cfg, num_layers, source)
    parallel = arch.startswith("FalconH1For")
    window = cfg.get("sliding_window") if "sliding" in kinds else None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return ModelConfig(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg.get("vocab_size", 0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        layer_kinds=kinds,
        sliding_window=int(window) if window else None,
        attention_chunk_size=cfg.get("attention_chunk_size"),
        dtype=dtype,
        source=source,
        hf_config=cfg,
        mamba=_mamba_shape(cfg, hidden, source) if "mamba" in kinds or parallel else None,
        parallel_mamba=parallel,
    )


def _mamba_shape(cfg: dict[str, Any], hidden: int, source: str) -> MambaShape:
    """Falcon-H1 / Granite hybrid `mamba_*` keys; a head size of "auto" divides the inner width."""
    heads = int(cfg.get("mamba_n_heads", 128))  # the defaults are transformers' own
    inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = int(inner) // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != int(inner):
        raise ValueError(
            f"{source}: mamba_n_heads {heads} × mamba_d_head {head_dim} != the Mamba inner width "
            f"{inner} (mamba_d_ssm, or mamba_expand × hidden_size)"
        )
    return MambaShape(
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(cfg.get("mamba_d_state", 256)),
        num_groups=int(cfg.get("mamba_n_groups", 1)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
    )


def _layer_kinds(arch: str, cfg: dict[str, Any], n: int, source: str) -> tuple[str, ...]:
    if arch.startswith("FalconH1For") and not cfg.get("layer_types"):
        return ("full",) * n  # attention in every layer; the Mamba2 mixer runs beside it
    if arch.startswith("GraniteMoeHybridFor"):
        types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
        try:
            return tuple(_GRANITE_LAYER_TYPES[t] for t in types)
        except KeyError as exc:
            raise ValueError(
                f"{source}: unknown layer type {exc.args[0]!r} in layer_types"
            ) from None
    if cfg.get("layer_types"):
        try:
            return tuple(_HF_LAYER_TYPES[t] for t in cfg["layer_types"])
        except KeyError as exc:
            raise ValueError(
                f"{source}: unknown layer type {exc.args[0]!r} in layer_types"
            ) from None
    if arch.startswith(("LlamaFor", "Llama4For")):
        if cfg.get("attention_chunk_size"):  # Llama-4 style: every 4th layer global, rest chunked
            return tuple("full" if (i + 1) % 4 == 0 else "chunked" for i in range(n))
        return ("full",) * n
    if arch.startswith("Qwen2For"):
        first_swa = int(cfg.get("max_window_layers", n))
        use = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window")
        return tuple("sliding" if use and i >= first_swa else "full" for i in range(n))
    if arch.startswith("MistralFor"):
        return ("sliding" if cfg.get("sliding_window") else "full",) * n
    if arch.startswith("Gemma2For"):
        return tuple("sliding" if (i + 1) % 2 else "full" for i in range(n))
    if arch.startswith("Gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))
    raise ValueError(
        f"{source}: architecture {arch!r} is not supported; supported: Llama, Qwen2, Mistral, "
        "Gemma2, Gemma3 (text), Falcon-H1, GraniteMoeHybrid"
    )
