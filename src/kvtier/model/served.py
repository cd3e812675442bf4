"""The model seam the runner drives: the plain decoder (`CausalLM`) and the Mamba2 hybrids
(`HybridLM`) behind one interface — each KV group's kind (an attention mask rule, or state), views
of the pool's flat page slots, one forward with attention and state metadata, and logits. The
runner never branches on the architecture; the models keep no state between forwards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvtier.config import ModelConfig
from kvtier.kv.plan import KVGroup
from kvtier.kv.specs import Mamba
from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.hf_config import load_model_config
from kvtier.model.hybrid import HybridLM
from kvtier.model.hybrid_loader import load_hybrid
from kvtier.model.loader import load_model, model_folder, resolve_quantization
from kvtier.model.mamba2 import MambaCache, StateMetadata
from kvtier.model.transformer import Attention, CausalLM


@dataclass(frozen=True)
class PoolCaches:
    """A model's views of the pool's layer slots: attention layers see [num_blocks, 2,
    block_size, kv_heads, head_dim], Mamba layers their conv and SSM states, by layer index."""

    attention: Mapping[int, torch.Tensor]
    state: Mapping[int, MambaCache]


class ServedModel(ABC):
    """What the runner needs of a model: its KV groups and their kinds, pool views, a forward."""

    def __init__(self, module: nn.Module, config: ModelConfig, kv_groups: tuple[KVGroup, ...]):
        self.module = module
        self.config = config
        self.kv_groups = kv_groups
        # per KV group: the attention mask rule, or None for a state (Mamba) group
        self.group_kinds: tuple[LayerKind | None, ...] = tuple(
            None if isinstance(g.spec, Mamba) else _kind(config, g) for g in kv_groups
        )

    @property
    def state_groups(self) -> tuple[int, ...]:
        """Indices of the KV groups that hold Mamba states."""
        return tuple(g for g, kind in enumerate(self.group_kinds) if kind is None)

    @abstractmethod
    def bind(self, slots: Sequence[torch.Tensor], block_size: int) -> PoolCaches:
        """Views of the pool's flat slots ([num_blocks, page elements] each) for every layer."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: PoolCaches,
        attn_metadata: AttentionMetadata,
        state_metadata: StateMetadata | None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] → final hidden states [num_tokens, hidden]; writes
        this forward's K/V and states into the pool through `caches`."""

    def kv_scales(self) -> list[tuple[float, float]]:
        """Each attention layer's (k_scale, v_scale), which an 8-bit KV cache applies: the
        checkpoint's where it has them (model/kv_scales.py), 1.0 otherwise."""
        return [(m.k_scale, m.v_scale) for m in self.module.modules() if isinstance(m, Attention)]

    def compute_logits(
        self, hidden_states: torch.Tensor, token_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] of the selected rows of `hidden_states` (all rows when None)."""
        logits: torch.Tensor = self.module.compute_logits(hidden_states, token_indices)  # type: ignore[operator]
        return logits

    def to(self, device: torch.device) -> ServedModel:
        """Move weights and static tables to `device` (mutates); returns self."""
        self.module.to(device)
        return self


class ServedDecoder(ServedModel):
    """A `CausalLM`: attention groups only."""

    def __init__(self, module: CausalLM) -> None:
        super().__init__(module, module.config, module.kv_groups)
        self.decoder = module

    def bind(self, slots: Sequence[torch.Tensor], block_size: int) -> PoolCaches:
        views = [_attention_view(self.config, t, block_size) for t in slots]
        slot_of = self.decoder.layer_slots()
        return PoolCaches({i: views[s] for i, s in enumerate(slot_of)}, {})

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: PoolCaches,
        attn_metadata: AttentionMetadata,
        state_metadata: StateMetadata | None,
    ) -> torch.Tensor:
        kv = [caches.attention[i] for i in range(self.config.num_layers)]
        hidden: torch.Tensor = self.decoder(input_ids, positions, kv, attn_metadata)
        return hidden


class ServedHybrid(ServedModel):
    """A `HybridLM`: attention groups and state groups over the same pool."""

    def __init__(self, module: HybridLM) -> None:
        super().__init__(module, module.config, module.kv_groups)
        self.hybrid = module

    def bind(self, slots: Sequence[torch.Tensor], block_size: int) -> PoolCaches:
        hybrid, cfg = self.hybrid, self.config
        attention = {
            i: _attention_view(cfg, slots[hybrid.slots[(i, False)]], block_size)
            for i in hybrid.attention_group
        }
        state = {i: hybrid.state_views(slots[hybrid.slots[(i, True)]]) for i in hybrid.state_group}
        return PoolCaches(attention, state)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: PoolCaches,
        attn_metadata: AttentionMetadata,
        state_metadata: StateMetadata | None,
    ) -> torch.Tensor:
        assert state_metadata is not None, "a hybrid forward needs its state metadata"
        hidden: torch.Tensor = self.hybrid(
            input_ids, positions, caches.attention, attn_metadata, caches.state, state_metadata
        )
        return hidden


def load_served(
    path: str | Path, dtype: str | torch.dtype | None = None, quantization: str | None = None
) -> ServedModel:
    """The model of a HF folder behind the seam: `load_hybrid` for a Mamba2 hybrid (its config
    has `mamba_*` sizes), `load_model` otherwise (with `quantization`, as `load_model` takes
    it); in eval mode, no gradients."""
    folder = model_folder(path)
    config = load_model_config(folder)
    if config.mamba is not None:
        if resolve_quantization(quantization, folder) is not None:
            raise ValueError(
                f"{folder}: int8 weights (--quantization, or a quantization_config) run on "
                "decoder-only models; this Mamba2 hybrid loads in its float dtype: drop "
                "--quantization and pass its unquantized checkpoint"
            )
        return ServedHybrid(load_hybrid(path, dtype))
    model = load_model(path, dtype, quantization=quantization)
    return ServedDecoder(model.eval().requires_grad_(False))


def _attention_view(config: ModelConfig, slot: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_blocks, page elements] → [num_blocks, 2, block_size, kv_heads, head_dim] (exact)."""
    return slot.view(slot.shape[0], 2, block_size, config.num_kv_heads, config.head_dim)


def _kind(config: ModelConfig, group: KVGroup) -> LayerKind:
    kind = config.layer_kinds[group.layer_indices[0]]
    if kind == "sliding":
        return LayerKind(window=config.sliding_window)
    if kind == "chunked":
        return LayerKind(chunk=config.attention_chunk_size)
    return LayerKind()
