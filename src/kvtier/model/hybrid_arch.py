"""Description of the Mamba2 hybrids read from a HF `config.json`: Falcon-H1 (attention and a Mamba2
mixer in parallel in every layer, µP multipliers) and GraniteMoeHybrid (Granite 4.0 hybrid: Mamba2
or attention per layer, optional MoE). Torch-free; ValueError names the unsupported field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import MambaShape, ModelConfig
from kvtier.model.arch import ArchSpec, rope_specs

HYBRIDS = ("FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM")


@dataclass(frozen=True)
class MixerSpec:
    """One Mamba2 mixer: geometry, biases, output norm, time-step limits."""

    shape: MambaShape
    chunk_size: int  # scan chunk of a prefill (any value gives the same result)
    in_bias: bool
    out_bias: bool
    conv_bias: bool
    gated_norm: bool  # grouped RMSNorm on the output and the gate; else y * silu(z)
    norm_before_gate: bool  # norm(y) * silu(z) instead of norm(y * silu(z))
    eps: float
    dt_min: float
    dt_max: float


@dataclass(frozen=True)
class Multipliers:
    """Scales of a linear map's input or output; the loader folds them into the weights, so they
    cost nothing at run time (1.0 everywhere is the plain model)."""

    key: float = 1.0  # Falcon-H1: k
    attention_in: float = 1.0  # Falcon-H1: the attention's input (q, k, v)
    attention_out: float = 1.0  # Falcon-H1: o_proj
    ssm_in: float = 1.0  # Falcon-H1: the mixer's input (in_proj)
    ssm_out: float = 1.0  # Falcon-H1: out_proj
    ssm: tuple[float, ...] = (1.0,) * 5  # Falcon-H1: in_proj's z, x, B, C, dt sections (µP)
    mlp_gate: float = 1.0  # Falcon-H1: gate_proj
    mlp_down: float = 1.0  # Falcon-H1: down_proj
    residual: float = 1.0  # Granite: every sublayer's output before the residual add


@dataclass(frozen=True)
class HybridSpec:
    """Everything the hybrid decoder needs beyond `ModelConfig`.

    `multipliers` are folded into the weights at load (`hybrid_loader.py`); the embedding and
    logits scales stay explicit because Granite ties the LM head to the embeddings.
    """

    family: str  # falcon_h1 | granitemoehybrid
    attention: ArchSpec  # attention, MLP and norms, shared with the plain decoder's modules
    mixer: MixerSpec
    embedding_multiplier: float
    logits_multiplier: float  # Falcon-H1 lm_head_multiplier; Granite 1 / logits_scaling
    num_experts: int  # routed MoE experts per layer (Granite; 0 = dense)
    num_experts_per_tok: int
    expert_intermediate_size: int
    multipliers: Multipliers


def hybrid_spec(config: ModelConfig) -> HybridSpec:
    """Derive the description; raises ValueError for what kvtier cannot run."""
    cfg, arch = config.hf_config, config.architecture
    if arch not in HYBRIDS or config.mamba is None:
        raise ValueError(
            f"{config.source}: {arch!r} is not a supported Mamba2 hybrid; supported: {HYBRIDS}"
        )
    falcon = arch.startswith("FalconH1")
    family = "falcon_h1" if falcon else "granitemoehybrid"
    act = str(cfg.get("hidden_act") or "silu")
    if act != "silu":  # the mixer's conv activation is hidden_act too
        raise ValueError(f"{config.source}: hidden_act {act!r} unsupported for hybrids; use silu")
    eps = float(cfg.get("rms_norm_eps") or (1e-5 if falcon else 1e-6))
    bias = bool(cfg.get("attention_bias", False))
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    mixer = MixerSpec(
        shape=config.mamba,
        chunk_size=int(cfg.get("mamba_chunk_size") or 256),
        in_bias=bool(cfg.get("mamba_proj_bias", False)),
        out_bias=bool(cfg.get("projectors_bias" if falcon else "mamba_proj_bias", False)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        gated_norm=bool(cfg.get("mamba_rms_norm", False)) if falcon else True,
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)) if falcon else False,
        eps=eps,
        dt_min=_float(limit[0]),
        dt_max=_float(limit[1]),
    )
    use_rope = falcon or cfg.get("position_embedding_type") == "rope"
    attention = ArchSpec(
        family=family,
        intermediate_size=int(  # transformers' defaults
            cfg.get("intermediate_size", 14336)
            if falcon
            else cfg.get("shared_intermediate_size", 1024)
        ),
        rms_norm_eps=eps,
        activation="silu",
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if falcon else False,
        gemma_norm=False,
        sandwich_norms=False,
        qk_norm=False,
        embed_scale=None,
        query_scale=config.head_dim**-0.5 if falcon else float(cfg.get("attention_multiplier", 1)),
        attn_softcap=None,
        final_softcap=None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_ropes=rope_specs(config, family) if use_rope else (),  # Granite 4.0-H: NoPE
    )
    experts = 0 if falcon else int(cfg.get("num_local_experts", 8))
    return HybridSpec(
        family=family,
        attention=attention,
        mixer=mixer,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_multiplier=(
            float(cfg.get("lm_head_multiplier", 1.0))
            if falcon
            else 1.0 / float(cfg.get("logits_scaling", 1.0))
        ),
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)) if experts else 0,
        expert_intermediate_size=int(cfg.get("intermediate_size", 11008)) if experts else 0,
        multipliers=_multipliers(cfg, config.source)
        if falcon
        else Multipliers(residual=_num(cfg, "residual_multiplier")),
    )


def _float(value: Any) -> float:
    """A number, or transformers' JSON spelling of a non-finite one ({"__float__": "Infinity"})."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _num(cfg: dict[str, Any], key: str) -> float:
    value = cfg.get(key)
    return 1.0 if value is None else float(value)


def _multipliers(cfg: dict[str, Any], source: str) -> Multipliers:
    mlp = tuple(float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    ssm = tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5)
    if len(mlp) != 2 or len(ssm) != 5:
        raise ValueError(
            f"{source}: mlp_multipliers needs 2 values (gate, down) and ssm_multipliers 5 "
            f"(z, x, B, C, dt); got {len(mlp)} and {len(ssm)}"
        )
    return Multipliers(
        key=_num(cfg, "key_multiplier"),
        attention_in=_num(cfg, "attention_in_multiplier"),
        attention_out=_num(cfg, "attention_out_multiplier"),
        ssm_in=_num(cfg, "ssm_in_multiplier"),
        ssm_out=_num(cfg, "ssm_out_multiplier"),
        ssm=ssm,
        mlp_gate=mlp[0],
        mlp_down=mlp[1],
    )
