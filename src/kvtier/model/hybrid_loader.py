"""Load a Falcon-H1 or GraniteMoeHybrid HF folder into a `HybridLM`: HF names to ours (fused q/k/v
and gate/up; Falcon's feed_forward / pre_ff_layernorm / final_layernorm and Granite's shared_mlp /
block_sparse_moe under the plain decoder's names), and the linear multipliers folded into weights
(in float32, before the cast). Every mismatch is a ValueError naming it and the fix."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.config import ModelConfig
from kvtier.model.hf_config import load_model_config
from kvtier.model.hybrid import HybridLM
from kvtier.model.hybrid_arch import HybridSpec, hybrid_spec
from kvtier.model.kv_scales import apply_kv_scales, check_kv_cache_scheme, take_kv_scales
from kvtier.model.loader import empty_weights, model_folder, read_safetensors, resolve_dtype

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "mamba.mup_vector")  # recomputed from config.json
_RENAMES = (  # (HF name part, ours), applied in order to each weight name
    ("model.final_layernorm.", "model.norm."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),
    (".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.down_proj."),
    (".block_sparse_moe.router.layer.weight", ".moe.router.weight"),
    (".block_sparse_moe.router.weight", ".moe.router.weight"),
    (".block_sparse_moe.input_linear.weight", ".moe.gate_up_proj"),
    (".block_sparse_moe.experts.gate_up_proj", ".moe.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".moe.down_proj"),
    (".block_sparse_moe.experts.down_proj", ".moe.down_proj"),
)


def load_hybrid(path: str | Path, dtype: str | torch.dtype | None = None) -> HybridLM:
    """Build the hybrid model of the folder's config.json and load its safetensors weights."""
    folder = model_folder(path)
    config = load_model_config(folder)
    spec = hybrid_spec(config)
    torch_dtype = resolve_dtype(dtype, folder, checkpoint=config.dtype)
    with empty_weights():
        model = HybridLM(config, spec)
    raw = read_safetensors(folder)
    check_kv_cache_scheme(config.hf_config, folder)
    kv_scales = take_kv_scales(raw, config.num_layers, folder)
    state = hybrid_state(raw, config, spec)
    state = {k: v.to(torch_dtype) for k, v in state.items()}
    expected = set(model.state_dict())
    if spec.attention.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match {config.architecture}: missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}; check `architectures`, `layer_types`, "
            "`num_local_experts` and `tie_word_embeddings` in config.json"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if spec.attention.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    apply_kv_scales(model.model.layers, kv_scales, folder)  # of K after the key multiplier
    return model.eval().requires_grad_(False)


def hybrid_state(
    raw: dict[str, torch.Tensor], config: ModelConfig, spec: HybridSpec
) -> dict[str, torch.Tensor]:
    """HF-named weights → ours, multipliers folded (at least float32)."""
    state: dict[str, torch.Tensor] = {}
    for name, value in raw.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        for old, new in _RENAMES:
            name = name.replace(old, new)
        state[name] = value.to(torch.promote_types(value.dtype, torch.float32))
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        _fold(state, p, spec)
        for kind in ("weight", "bias"):
            _fuse(
                state,
                [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"],
                f"{p}self_attn.qkv_proj.{kind}",
            )
            _fuse(
                state,
                [f"{p}mlp.{x}_proj.{kind}" for x in ("gate", "up")],
                f"{p}mlp.gate_up_proj.{kind}",
            )
    return state


def _fold(state: dict[str, torch.Tensor], p: str, spec: HybridSpec) -> None:
    """Each multiplier scales a linear map's input (the weight) or output (weight and bias)."""
    m = spec.multipliers
    for x in "qkv":
        _scale(state, f"{p}self_attn.{x}_proj", m.attention_in, bias=False)
    _scale(state, p + "self_attn.k_proj", m.key)
    _scale(state, p + "self_attn.o_proj", m.attention_out * m.residual)
    _scale(state, p + "mamba.in_proj", m.ssm_in, bias=False)
    _scale(state, p + "mamba.in_proj", _mup_vector(spec))
    _scale(state, p + "mamba.out_proj", m.ssm_out * m.residual)
    _scale(state, p + "mlp.gate_proj", m.mlp_gate)
    _scale(state, p + "mlp.down_proj", m.mlp_down * m.residual)
    if p + "moe.down_proj" in state:  # stacked experts [E, hidden, intermediate]
        state[p + "moe.down_proj"] = state[p + "moe.down_proj"] * m.residual


def _mup_vector(spec: HybridSpec) -> torch.Tensor:
    """Per output row of in_proj: its section's SSM multiplier (z, x, B, C, dt)."""
    s = spec.mixer.shape
    gn = s.num_groups * s.state_size
    sizes = (s.intermediate_size, s.intermediate_size, gn, gn, s.num_heads)
    factors = spec.multipliers.ssm
    return torch.cat([torch.full((n,), f) for n, f in zip(sizes, factors, strict=True)])


def _scale(
    state: dict[str, torch.Tensor], prefix: str, factor: float | torch.Tensor, bias: bool = True
) -> None:
    """Scale `prefix`.weight (by rows when `factor` is a vector) and, if `bias`, its bias."""
    for kind in ("weight", "bias") if bias else ("weight",):
        name = f"{prefix}.{kind}"
        if name in state:
            f = factor[:, None] if isinstance(factor, torch.Tensor) and kind == "weight" else factor
            state[name] = state[name] * f


def _fuse(state: dict[str, torch.Tensor], names: list[str], fused: str) -> None:
    if all(n in state for n in names):
        state[fused] = torch.cat([state.pop(n) for n in names], dim=0)
