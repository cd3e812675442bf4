"""The decoder-only transformer for every supported architecture (differences come from `ArchSpec`).

gpt-fast style: `forward(input_ids, positions, kv_caches, attn_metadata)` takes every input as an
argument; the module holds only weights and static tables, nothing per step.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.config import ModelConfig
from kvtier.kv.plan import KVGroup, group_layers
from kvtier.model import native
from kvtier.model.arch import ArchSpec, arch_spec
from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.fused_layer import FusedLayers
from kvtier.model.layers import GatedMLP, Linear, RMSNorm, apply_rope, inv_freq, rope_tables
from kvtier.model.paged import MAX_BATCHED_QUERY, GroupPlan, paged_attention, plan_group


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, native: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=spec.o_bias)
        eps = spec.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, True, native) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, True, native) if spec.qk_norm else None
        self.split = (q_size, kv_size, kv_size)
        self.scale = spec.query_scale
        self.softcap = spec.attn_softcap
        # An 8-bit cache's per-tensor scales (vLLM's k_scale/v_scale): 1.0, vLLM's default for a
        # checkpoint without them; a float cache ignores them
        self.k_scale = self.v_scale = 1.0
        self.native = native

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        plan: GroupPlan,
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads, dim = (
            x.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KVH) * D]
        v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)  # [T, KVH, D]
        if self.q_norm is None or self.k_norm is None:  # q and k rotated together
            qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)
            qk = apply_rope(qk, *rope, native=self.native)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k, _ = qkv.split(self.split, dim=-1)
            q = self.q_norm(q.view(num_tokens, heads, dim))  # [T, H, D]
            k = self.k_norm(k.view(num_tokens, kv_heads, dim))  # [T, KVH, D]
            q = apply_rope(q, *rope, native=self.native)
            k = apply_rope(k, *rope, native=self.native)
        out = paged_attention(
            q, k, v, kv_cache, plan, self.scale, self.softcap, self.k_scale, self.v_scale
        )
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, -1))
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, native: bool) -> None:
        super().__init__()
        h, eps, gemma = config.hidden_size, spec.rms_norm_eps, spec.gemma_norm
        self.self_attn = Attention(config, spec, native)
        self.mlp = GatedMLP(h, spec.intermediate_size, spec.activation, spec.mlp_bias, native)
        self.input_layernorm = RMSNorm(h, eps, gemma, native)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma, native)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, gemma, native)
            self.post_feedforward_layernorm = RMSNorm(h, eps, gemma, native)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        plan: GroupPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (x', residual'): the hidden state is residual + x (just x before the
        first layer), so each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        attn = self.self_attn(h, rope, kv_cache, plan)
        ffn: torch.Tensor
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.forward_add(attn, residual)
            return self.mlp(h), residual
        attn = self.post_attention_layernorm(attn)
        h, residual = self.pre_feedforward_layernorm.forward_add(attn, residual)
        ffn = self.post_feedforward_layernorm(self.mlp(h))
        return ffn, residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, native: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, native) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, spec.rms_norm_eps, spec.gemma_norm, native)


class CausalLM(nn.Module):
    """A decoder with an LM head; parameter names follow HF except the fused qkv / gate_up."""

    def __init__(
        self, config: ModelConfig, spec: ArchSpec | None = None, *, native: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        # model/native.py's kernels where they serve (CPU, float32 or bfloat16), else torch ops
        self.native = native
        self.spec = spec = spec or arch_spec(config)
        self.model = DecoderModel(config, spec, native)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_groups: tuple[KVGroup, ...] = group_layers(config, 1)[0]
        self.layer_group = [0] * config.num_layers  # KV group index of each layer
        for g, group in enumerate(self.kv_groups):
            for i in group.layer_indices:
                self.layer_group[i] = g
        self.group_kinds = [
            _kind(config, config.layer_kinds[g.layer_indices[0]]) for g in self.kv_groups
        ]
        ropes = sorted(set(spec.layer_ropes), key=spec.layer_ropes.index)
        self.layer_rope = [ropes.index(r) for r in spec.layer_ropes]
        for r, rope in enumerate(ropes):  # float32 tables, kept float32 by `rope_tables`
            self.register_buffer(f"inv_freq_{r}", inv_freq(rope, config.head_dim), persistent=False)
        self.num_ropes = len(ropes)
        # decode steps' layers as one native call each where they serve; None: always Python
        self.fused: FusedLayers | None = FusedLayers() if native else None

    def layer_slots(self) -> list[int]:
        """KV pool slot of each layer: layer `group.layer_indices[s]` uses slot s."""
        slots = [0] * self.config.num_layers
        for group in self.kv_groups:
            for s, i in enumerate(group.layer_indices):
                slots[i] = s
        return slots

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Zeroed pool slots laid out as `KVLayout`, returned per layer (layers share slots)."""
        cfg = self.config
        num_slots = max(len(g.layer_indices) for g in self.kv_groups)
        shape = (num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = dtype or self.model.embed_tokens.weight.dtype
        pool = [torch.zeros(shape, dtype=dtype) for _ in range(num_slots)]
        return [pool[s] for s in self.layer_slots()]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] → final hidden states [num_tokens, hidden].

        `kv_caches[i]` is layer i's KV tensor (the pool slot of its group); K/V of this forward's
        tokens are written there through the metadata's slot mapping of the layer's group.
        """
        kvh = self.config.num_kv_heads
        group_size = self.config.num_heads // kvh
        weight = self.model.embed_tokens.weight  # of the queries' dtype and device
        use_native = self.native and native.attention_usable(weight, kv_caches[0])
        layers = list(self.model.layers)
        chunks = (  # a prompt's chunk in a step that can run as one call per layer
            use_native
            and self.fused is not None
            and max(attn_metadata.query_lens, default=0) > MAX_BATCHED_QUERY
            and self.fused.takes(layers, input_ids.shape[0])
        )
        plans = [
            plan_group(
                attn_metadata, g, kind, kvh, group_size, native=use_native, native_chunks=chunks
            ).to(input_ids.device)
            for g, kind in enumerate(self.group_kinds)
        ]
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.spec.embed_scale is not None:
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        ropes = [
            rope_tables(getattr(self, f"inv_freq_{r}").float(), positions, h.dtype)
            for r in range(self.num_ropes)
        ]
        done = None
        if use_native and self.fused is not None:
            done = self.fused.run(
                layers, h, ropes, self.layer_rope, kv_caches, plans, self.layer_group
            )
        if done is not None:
            hidden, _ = self.model.norm.forward_add(*done)
            return hidden
        residual: torch.Tensor | None = None
        for i, layer in enumerate(layers):
            rope = ropes[self.layer_rope[i]]
            h, residual = layer(h, residual, rope, kv_caches[i], plans[self.layer_group[i]])
        if residual is None:
            return self.model.norm(h)  # type: ignore[no-any-return]
        hidden, _ = self.model.norm.forward_add(h, residual)
        return hidden

    def compute_logits(
        self, hidden_states: torch.Tensor, token_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] of the selected rows of `hidden_states` (all rows when None)."""
        if token_indices is not None:
            hidden_states = hidden_states[token_indices]
        logits: torch.Tensor = self.lm_head(hidden_states)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _kind(config: ModelConfig, kind: str) -> LayerKind:
    if kind == "sliding":
        return LayerKind(window=config.sliding_window)
    if kind == "chunked":
        return LayerKind(chunk=config.attention_chunk_size)
    return LayerKind()
