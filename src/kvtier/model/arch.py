"""Architecture description read from a HF `config.json`: what differs between Llama, Qwen2,
Mistral, Gemma2 and Gemma3 text as plain fields, so one decoder implementation serves all of them.
Torch-free; raises ValueError naming the unsupported field and what to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM")
SUPPORTED_PREFIXES = ("Gemma3ForCausalLM", "Gemma3TextForCausalLM")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind: base frequency and optional scaling."""

    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchSpec:
    """Everything the decoder needs beyond `ModelConfig`; one value per architecture difference."""

    family: str  # llama | qwen2 | mistral | gemma2 | gemma3
    intermediate_size: int
    rms_norm_eps: float
    activation: str  # silu | gelu_tanh | gelu
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    gemma_norm: bool  # RMSNorm scales by (1 + w) and computes in float32 (Gemma)
    sandwich_norms: bool  # post-attention, pre- and post-FFN norms (Gemma2/3)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Gemma3)
    embed_scale: float | None  # multiply embeddings by this (Gemma: sqrt(hidden))
    query_scale: float  # softmax scale: head_dim**-0.5 or query_pre_attn_scalar**-0.5
    attn_softcap: float | None
    final_softcap: float | None
    tie_word_embeddings: bool
    layer_ropes: tuple[RopeSpec, ...]  # one per layer


def arch_spec(config: ModelConfig) -> ArchSpec:
    """Derive the architecture description; raises ValueError for what kvtier cannot run."""
    cfg = config.hf_config
    arch = config.architecture
    if config.mamba is not None:
        raise ValueError(
            f"{config.source}: {arch} is a Mamba2 hybrid; load it with "
            "kvtier.model.hybrid_loader.load_hybrid (kvtier.model.served.load_served loads either "
            "kind, as the engine does)"
        )
    if arch not in SUPPORTED and not arch.startswith(SUPPORTED_PREFIXES):
        raise ValueError(
            f"{config.source}: architecture {arch!r} is not supported by kvtier.model; supported: "
            f"{', '.join(SUPPORTED + SUPPORTED_PREFIXES)} (set `architectures` in config.json)"
        )
    family = arch.removesuffix("ForCausalLM").removesuffix("Text").lower()
    gemma = family in ("gemma2", "gemma3")
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ValueError(
            f"{config.source}: activation {act_name!r} unsupported; use one of {list(_ACTIVATIONS)}"
        )
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"{config.source}: partial_rotary_factor != 1 is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{config.source}: use_bidirectional_attention (encoder mode) unsupported")
    attention_bias = bool(cfg.get("attention_bias", False))
    scalar = cfg.get("query_pre_attn_scalar", 256) if gemma else None
    return ArchSpec(
        family=family,
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation=_ACTIVATIONS[act_name],
        qkv_bias=attention_bias or family == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        gemma_norm=gemma,
        sandwich_norms=gemma,
        qk_norm=family == "gemma3",
        embed_scale=config.hidden_size**0.5 if gemma else None,
        query_scale=float(scalar) ** -0.5 if scalar else config.head_dim**-0.5,
        attn_softcap=_opt_float(
            cfg.get("attn_logit_softcapping", 50.0 if family == "gemma2" else None)
        ),
        final_softcap=_opt_float(
            cfg.get("final_logit_softcapping", 30.0 if family == "gemma2" else None)
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        layer_ropes=rope_specs(config, family),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def rope_specs(config: ModelConfig, family: str) -> tuple[RopeSpec, ...]:
    cfg = config.hf_config
    params = cfg.get("rope_parameters") or {}
    nested = isinstance(params.get("full_attention"), dict) or isinstance(
        params.get("sliding_attention"), dict
    )
    if family == "gemma3":
        full = dict(params.get("full_attention") or {}) if nested else {}
        local = dict(params.get("sliding_attention") or {}) if nested else {}
        if not nested and cfg.get("rope_scaling"):
            full.update(cfg["rope_scaling"])  # legacy rope_scaling applies to global layers only
        full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
        by_kind = {"full": _rope(full, config), "sliding": _rope(local, config)}
        return tuple(by_kind[k] for k in config.layer_kinds)
    if nested:
        raise ValueError(
            f"{config.source}: per-layer-type rope_parameters unsupported for {family}"
        )
    merged = dict(cfg.get("rope_scaling") or {})
    merged.update(params)
    merged.setdefault("rope_theta", cfg.get("rope_theta") or 10_000.0)
    rope = _rope(merged, config)
    return (rope,) * config.num_layers


def _rope(params: dict[str, Any], config: ModelConfig) -> RopeSpec:
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{config.source}: rope type {rope_type!r} is not supported; supported: {_ROPE_TYPES}"
        )
    return RopeSpec(
        theta=float(params["rope_theta"]),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", config.max_position_embeddings)
        ),
    )
