"""Tiny random HF-format model folders (config.json, model.safetensors, byte-level tokenizer.json,
tokenizer_config.json, generation_config.json) for every supported architecture, the Mamba2 hybrids
included. Weights are scaled so attention is far from uniform, Mamba states remember tens of tokens
and logits spread widely: continuations depend on the prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

ARCHITECTURES = ("llama", "llama_chunked", "qwen2", "mistral", "gemma2", "gemma3")
HYBRID_ARCHITECTURES = ("falcon_h1", "granite_hybrid")  # loaded with `hybrid_loader.load_hybrid`
POST_NORM_GAIN = 6.0  # Gemma: layer outputs outweigh the sqrt(hidden)-scaled embeddings
NUM_SPECIAL = 3  # <pad>=0, <bos>=1, <eos>=2; then one token per byte value


def tiny_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 320,
    window: int | None = 8,
    chunk: int = 8,
    dtype: str = "float32",
    intermediate_size: int | None = None,
    sliding_window_pattern: int = 3,  # gemma3: every n-th layer global, the others sliding
    max_position_embeddings: int = 1024,
) -> dict[str, Any]:
    """A HF config.json dict for `arch` (one of ARCHITECTURES) at toy size (intermediate size
    2 × hidden unless given; `window=None`: Qwen2 and Mistral attend fully on every layer)."""
    if arch not in ARCHITECTURES:
        known = ARCHITECTURES + HYBRID_ARCHITECTURES
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {known}")
    cfg: dict[str, Any] = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
    }
    if arch in ("llama", "llama_chunked"):
        cfg |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        if arch == "llama_chunked":
            cfg["attention_chunk_size"] = chunk
    elif arch == "qwen2":
        cfg |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
        if window is not None:
            cfg |= {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}
        cfg["tie_word_embeddings"] = True
    elif arch == "mistral":
        cfg |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
        cfg["sliding_window"] = window
    else:
        del cfg["hidden_act"]
        cfg |= {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
        cfg |= {"sliding_window": window, "query_pre_attn_scalar": 24}
        if arch == "gemma2":
            cfg |= {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
            cfg |= {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0}
        else:
            cfg |= {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
            pattern = sliding_window_pattern
            cfg |= {"sliding_window_pattern": pattern, "rope_local_base_freq": 100.0}
            cfg["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
            cfg |= {"rope_theta": 1_000_000.0, "attn_logit_softcapping": None}
            cfg["final_logit_softcapping"] = None
    return cfg


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights: unit-variance activations, sharp attention, wide logits."""
    gen = torch.Generator().manual_seed(seed)
    gemma = cfg["model_type"].startswith("gemma")
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(dim: int, gain: float = 1.0) -> torch.Tensor:
        return gain - 1.0 + rand(dim, std=0.1) if gemma else gain + rand(dim, std=0.1)

    # Tied models read logits off the input embeddings: keep embeddings small beside the layer
    # outputs (else every token predicts itself) and let the LM head spread logits to std ~3.
    tied = cfg["tie_word_embeddings"]
    embed_std = 1.5 / math.sqrt(h) if tied else (h**-0.5 if gemma else 1.0)
    post_gain = POST_NORM_GAIN if gemma else 1.0
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h, std=embed_std),
        "model.norm.weight": norm(h, 2.0 if tied else 1.0),
    }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(cfg["vocab_size"], h, std=3.0 / math.sqrt(h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(nh * d, h, std=1.5 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = rand(nkv * d, h, std=1.5 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = rand(nkv * d, h, std=1.0 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = rand(h, nh * d, std=1.0 / math.sqrt(nh * d))
        w[p + "mlp.gate_proj.weight"] = rand(inter, h, std=1.0 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = rand(inter, h, std=1.0 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = rand(h, inter, std=1.0 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h, post_gain)
        if cfg["model_type"] == "qwen2":
            for name, size in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
                w[p + f"self_attn.{name}_proj.bias"] = rand(size, std=0.1)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h, post_gain)
        if cfg["model_type"] == "gemma3_text":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
    return w


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: 3 specials, then token 3 + b for byte b; no merges."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = NUM_SPECIAL + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 1)]
    )
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte value."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_tiny_model(folder: str | Path, arch: str, seed: int = 0, **config: Any) -> Path:
    """Write a complete tiny HF model folder for `arch`; `config` overrides `tiny_config` args
    (`tiny_hybrid_config` args and config.json keys for the hybrids)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    hybrid = arch in HYBRID_ARCHITECTURES
    cfg = tiny_hybrid_config(arch, **config) if hybrid else tiny_config(arch, **config)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = random_hybrid_weights(cfg, seed) if hybrid else random_weights(cfg, seed)
    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))  # saved as the config says
    save_file(
        {k: v.to(dtype).contiguous() for k, v in weights.items()}, str(out / "model.safetensors")
    )
    byte_tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    gen_cfg = {"bos_token_id": 1, "eos_token_id": [2], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=1))
    return out


INT8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int8_model(
    source: str | Path,
    folder: str | Path,
    fmt: str = "int-quantized",
    lm_head: bool = False,
    activations: dict[str, Any] | None = None,
) -> Path:
    """Copy the model folder `source` into `folder` with its decoder linears (and the lm_head if
    asked and untied) quantized to int8 in compressed-tensors' layout, as llm-compressor writes a
    W8A16 channel-wise scheme: `fmt` "int-quantized" (`weight` int8) or "pack-quantized"
    (`weight_packed` int32 + `weight_shape`), `weight_scale` [n, 1] in the checkpoint's dtype.
    `activations`: the group's `input_activations` (W8A8_ACTIVATIONS: llm-compressor's W8A8
    scheme, int8 per token, dynamic), None for weight-only."""
    from kvtier.model.quant import CT_FORMATS, pack_int8, quantize_int8

    if fmt not in CT_FORMATS:
        raise ValueError(f"fmt must be one of {CT_FORMATS}, got {fmt!r}")
    src, out = Path(source), Path(folder)
    tensors = _copy_but_weights(src, out)
    weights: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        module = key.removesuffix(".weight")
        int8 = key.endswith(".weight") and (
            module.rsplit(".", 1)[-1] in INT8_LINEARS or (lm_head and module == "lm_head")
        )
        if not int8:
            weights[key] = w
            continue
        q, scale = quantize_int8(w)
        weights[f"{module}.weight_scale"] = scale.to(w.dtype)[:, None].contiguous()
        if fmt == "pack-quantized":
            weights[f"{module}.weight_packed"] = pack_int8(q)
            weights[f"{module}.weight_shape"] = torch.tensor(q.shape)
        else:
            weights[f"{module}.weight"] = q
    save_file(weights, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
              "group_size": None, "block_structure": None, "dynamic": False, "actorder": None,
              "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": scheme,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt,
            },
        },
        "ignore": [] if lm_head else ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


# How each tool names a layer's KV scale tensors, after "model.layers.{i}.self_attn."
KV_SCALE_NAMES = {
    "compressed-tensors": ("k_scale", "v_scale"),  # llm-compressor's kv_cache_scheme
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale"),
    "output-scale": ("k_proj.output_scale", "v_proj.output_scale"),  # older llm-compressor
    "kv-scale": ("kv_scale",),  # the legacy single scale (k's is written)
}
FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                 "dynamic": False, "group_size": None, "block_structure": None,
                 "actorder": None, "observer": "minmax", "observer_kwargs": {}}  # fmt: skip


def write_kv_scaled_model(
    source: str | Path,
    folder: str | Path,
    scales: dict[int, tuple[float, float]],
    naming: str = "compressed-tensors",
    scheme: dict[str, Any] | None = FP8_KV_SCHEME,
) -> Path:
    """Copy the model folder `source` into `folder` with per-layer KV scales (layer → (k_scale,
    v_scale)) as float32 scalars under `naming`'s tensor names (KV_SCALE_NAMES), and `scheme` as
    config.json's compressed-tensors `kv_cache_scheme` (None: no quantization_config added), as
    llm-compressor writes a model whose KV cache it calibrated for fp8."""
    src, out = Path(source), Path(folder)
    tensors = _copy_but_weights(src, out)
    for layer, pair in scales.items():
        for name, value in zip(KV_SCALE_NAMES[naming], pair, strict=False):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if scheme is not None:
        qc = config.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
        qc.setdefault("config_groups", {})
        qc["kv_cache_scheme"] = scheme
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def tiny_hybrid_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 320,
    chunk_size: int = 8,
    num_experts: int = 4,
    **overrides: Any,
) -> dict[str, Any]:
    """A HF config.json dict for a Mamba2 hybrid (one of HYBRID_ARCHITECTURES) at toy size, with
    every multiplier away from 1 so a forgotten one shows; `overrides` are config.json keys."""
    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(f"unknown tiny hybrid {arch!r}; use one of {HYBRID_ARCHITECTURES}")
    cfg: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "mamba_n_groups": 2,
        "mamba_d_conv": 4,
        "mamba_chunk_size": chunk_size,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    }
    if arch == "falcon_h1":
        cfg |= {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1"}
        cfg |= {"num_hidden_layers": 3, "intermediate_size": 2 * hidden_size, "rms_norm_eps": 1e-5}
        cfg |= {"mamba_d_ssm": 128, "mamba_expand": 2, "mamba_rms_norm": False}
        cfg |= {"mamba_norm_before_gate": False, "projectors_bias": False}
        cfg |= {"tie_word_embeddings": False, "embedding_multiplier": 1.5}
        cfg |= {"lm_head_multiplier": 0.9, "key_multiplier": 0.8, "attention_in_multiplier": 1.2}
        cfg |= {"attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.1}
        cfg |= {"ssm_out_multiplier": 0.7, "mlp_multipliers": [1.3, 0.8]}
        cfg["ssm_multipliers"] = [0.9, 1.1, 0.8, 1.2, 1.05]
    else:  # Granite 4.0 hybrid: Mamba2 layers around one attention layer, NoPE, tied head
        cfg |= {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid"}
        cfg |= {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"]}
        cfg |= {"intermediate_size": hidden_size // 2, "shared_intermediate_size": 2 * hidden_size}
        cfg |= {"num_local_experts": num_experts, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6}
        cfg |= {"mamba_expand": 2, "position_embedding_type": "nope", "tie_word_embeddings": True}
        cfg |= {"embedding_multiplier": 2.0, "residual_multiplier": 0.6}
        cfg |= {"attention_multiplier": 0.3, "logits_scaling": 1.5}
    return cfg | overrides


def random_hybrid_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of a tiny hybrid (HF's own names, Granite's legacy MoE names)."""
    gen = torch.Generator().manual_seed(seed)
    falcon = cfg["model_type"] == "falcon_h1"
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    heads, groups, state = cfg["mamba_n_heads"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
    inner = heads * cfg["mamba_d_head"]
    conv_dim = inner + 2 * groups * state

    def rand(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + torch.randn(*shape, generator=gen) * std

    tied = cfg["tie_word_embeddings"]
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(
            cfg["vocab_size"], h, std=1.0 / math.sqrt(h) if tied else 1.0
        ),
        ("model.final_layernorm.weight" if falcon else "model.norm.weight"): rand(
            h, std=0.1, mean=2.0 if tied else 1.0
        ),
    }
    if not tied:
        w["lm_head.weight"] = rand(cfg["vocab_size"], h, std=3.0 / math.sqrt(h))
    kinds = ["hybrid"] * n if falcon else cfg["layer_types"]
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rand(h, std=0.1, mean=1.0)
        w[p + ("pre_ff_layernorm" if falcon else "post_attention_layernorm") + ".weight"] = rand(
            h, std=0.1, mean=1.0
        )
        if kind != "mamba":
            for name, rows, std in (("q", nh * d, 1.5), ("k", nkv * d, 1.5), ("v", nkv * d, 1.0)):
                w[p + f"self_attn.{name}_proj.weight"] = rand(rows, h, std=std / math.sqrt(h))
            w[p + "self_attn.o_proj.weight"] = rand(h, nh * d, std=1.0 / math.sqrt(nh * d))
            if cfg.get("attention_bias"):
                for name, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d), ("o", h)):
                    w[p + f"self_attn.{name}_proj.bias"] = rand(rows, std=0.1)
        if kind != "attention":
            m = p + "mamba."
            w[m + "in_proj.weight"] = rand(
                2 * inner + 2 * groups * state + heads, h, std=1.0 / math.sqrt(h)
            )
            w[m + "conv1d.weight"] = rand(conv_dim, 1, cfg["mamba_d_conv"], std=0.5)
            w[m + "conv1d.bias"] = rand(conv_dim, std=0.1)
            w[m + "dt_bias"] = rand(heads, std=0.5, mean=-1.0)  # softplus: steps of about 0.3
            w[m + "A_log"] = torch.log(torch.rand(heads, generator=gen) * 1.9 + 0.1)  # slow decay
            w[m + "D"] = rand(heads, std=0.1, mean=1.0)
            w[m + "out_proj.weight"] = rand(h, inner, std=1.0 / math.sqrt(inner))
            if cfg.get("mamba_proj_bias"):
                w[m + "in_proj.bias"] = rand(2 * inner + 2 * groups * state + heads, std=0.1)
            if cfg.get("projectors_bias" if falcon else "mamba_proj_bias"):
                w[m + "out_proj.bias"] = rand(h, std=0.1)
            if not falcon or cfg.get("mamba_rms_norm"):
                w[m + "norm.weight"] = rand(inner, std=0.1, mean=1.0)
        if falcon:
            inter = cfg["intermediate_size"]
            w[p + "feed_forward.gate_proj.weight"] = rand(inter, h, std=1.0 / math.sqrt(h))
            w[p + "feed_forward.up_proj.weight"] = rand(inter, h, std=1.0 / math.sqrt(h))
            w[p + "feed_forward.down_proj.weight"] = rand(h, inter, std=1.0 / math.sqrt(inter))
            continue
        shared = cfg["shared_intermediate_size"]
        w[p + "shared_mlp.input_linear.weight"] = rand(2 * shared, h, std=1.0 / math.sqrt(h))
        w[p + "shared_mlp.output_linear.weight"] = rand(h, shared, std=1.0 / math.sqrt(shared))
        if (experts := cfg["num_local_experts"]) > 0:
            inter, moe = cfg["intermediate_size"], p + "block_sparse_moe."
            w[moe + "router.layer.weight"] = rand(experts, h, std=1.0 / math.sqrt(h))
            w[moe + "input_linear.weight"] = rand(experts, 2 * inter, h, std=1.0 / math.sqrt(h))
            w[moe + "output_linear.weight"] = rand(experts, h, inter, std=1.0 / math.sqrt(inter))
    return w


def _copy_but_weights(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """Copy model folder `src`'s files but its weights and config.json into `out` (created);
    return its weights, every shard's tensors by name, for the caller to rewrite."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(shard))
    return tensors
