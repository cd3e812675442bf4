"""The Mamba2 hybrid decoders: Falcon-H1 (attention and a Mamba2 mixer side by side in every
layer) and GraniteMoeHybrid (attention or a Mamba2 mixer per layer; a dense MLP plus optional
routed experts). Attention, MLP and norms are the plain decoder's modules; the differences come
from `HybridSpec`.

gpt-fast style: `forward(input_ids, positions, kv_caches, attn_metadata, state_caches,
state_metadata)` takes every input as an argument; the module holds only weights and static tables.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import ModelConfig
from kvtier.kv.plan import KVGroup, group_layers
from kvtier.kv.specs import Mamba
from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.hybrid_arch import HybridSpec, hybrid_spec
from kvtier.model.layers import GatedMLP, RMSNorm, inv_freq, rope_tables
from kvtier.model.mamba2 import Mamba2Mixer, MambaCache, StateMetadata, StatePlan
from kvtier.model.paged import GroupPlan, plan_group
from kvtier.model.transformer import Attention


class SparseMoE(nn.Module):
    """Top-k routed experts: softmax over the k best router logits weights each expert's
    down(act(gate(x)) * up(x)). Expert weights are stacked [E, 2I, H] and [E, H, I].

    On the host CPU the experts a step routes to run one by one (`experts_by_expert`); on an
    accelerator every expert runs on every token under a dense routing matrix
    (`experts_dense`), so no op reads the routing back and waits for the device."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).float()  # [T, E]
        best, experts = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(best, dim=-1).to(x.dtype)
        route = experts_by_expert if x.device == HOST else experts_dense
        return route(x, experts, weights, self.gate_up_proj, self.down_proj)


HOST = torch.device("cpu")
# Elements of one token chunk's expert activations [E, chunk, 2I] in the dense route: bounds
# its memory whatever the batch; the chunk count follows from shapes, not data.
DENSE_CHUNK_ELEMENTS = 1 << 24


def experts_by_expert(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """x [T, H], experts / weights [T, k] → [T, H], computing only the (token, expert) pairs
    routed: the fewest FLOPs, but it reads which experts were chosen (a device sync on cuda)."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.nonzero(experts == e, as_tuple=True)
        g, u = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    return out


def experts_dense(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`experts_by_expert`'s result with shapes fixed by T and E alone: every expert on every
    token (E / k times the routed FLOPs), summed under a [T, E] routing matrix that is zero
    where a token did not choose the expert. Nothing is read back to the host."""
    num_tokens = x.shape[0]
    num_experts, width, _ = gate_up.shape
    route = x.new_zeros(num_tokens, num_experts).scatter_(1, experts, weights)  # [T, E]
    chunk = max(1, DENSE_CHUNK_ELEMENTS // (num_experts * width))
    pieces = []
    for start in range(0, num_tokens, chunk):
        xs = x[start : start + chunk]  # [t, H]
        g, u = torch.matmul(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, t, I] each
        y = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [E, t, H]
        pieces.append(torch.einsum("eth,te->th", y, route[start : start + chunk]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class HybridLayer(nn.Module):
    """Norm → Mamba2 mixer and/or attention (their outputs summed) → residual → norm → MLP (+
    experts) → residual."""

    def __init__(self, config: ModelConfig, spec: HybridSpec, attention: bool, mamba: bool) -> None:
        super().__init__()
        h, a = config.hidden_size, spec.attention
        self.input_layernorm = RMSNorm(h, a.rms_norm_eps, False)
        self.self_attn = Attention(config, a, native=False) if attention else None
        self.mamba = Mamba2Mixer(h, spec.mixer) if mamba else None
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps, False)
        self.mlp = GatedMLP(h, a.intermediate_size, a.activation, a.mlp_bias)
        self.moe = (
            SparseMoE(h, spec.expert_intermediate_size, spec.num_experts, spec.num_experts_per_tok)
            if spec.num_experts
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor | None,
        attn_plan: GroupPlan | None,
        state: MambaCache | None,
        state_plan: StatePlan | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed: torch.Tensor | None = None
        if self.mamba is not None:
            assert state is not None and state_plan is not None
            mixed = self.mamba(h, state, state_plan)
        if self.self_attn is not None:
            assert kv_cache is not None and attn_plan is not None
            attn = self.self_attn(h, rope, kv_cache, attn_plan)
            mixed = attn if mixed is None else mixed + attn
        assert mixed is not None
        x = x + mixed
        h = self.post_attention_layernorm(x)
        ffn: torch.Tensor = self.mlp(h)
        if self.moe is not None:
            ffn = self.moe(h) + ffn
        return x + ffn


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: HybridSpec) -> None:
        super().__init__()
        kinds = config.layer_kinds
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridLayer(
                config, spec, kinds[i] != "mamba", kinds[i] == "mamba" or config.parallel_mamba
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, spec.attention.rms_norm_eps, False)


class HybridLM(nn.Module):
    """A hybrid decoder with an LM head. KV groups (`kv_groups`, from kv/plan.py `group_layers`)
    hold attention layers or Mamba layers; a layer of Falcon-H1 is in one group of each kind."""

    def __init__(self, config: ModelConfig, spec: HybridSpec | None = None) -> None:
        super().__init__()
        self.config = config
        self.spec = spec = spec or hybrid_spec(config)
        self.model = HybridModel(config, spec)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if spec.attention.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_groups: tuple[KVGroup, ...] = group_layers(config, 1)[0]
        self.attention_group: dict[int, int] = {}  # layer → its attention KV group
        self.state_group: dict[int, int] = {}  # layer → its Mamba KV group
        self.slots: dict[tuple[int, bool], int] = {}  # (layer, is Mamba) → pool slot
        for g, group in enumerate(self.kv_groups):
            is_state = isinstance(group.spec, Mamba)
            for s, i in enumerate(group.layer_indices):
                (self.state_group if is_state else self.attention_group)[i] = g
                self.slots[(i, is_state)] = s
        window = config.sliding_window  # attention groups: causal, or a sliding window
        self.group_kinds = {
            g: LayerKind(window=window if config.layer_kinds[i] == "sliding" else None)
            for i, g in self.attention_group.items()
        }
        ropes = set(spec.attention.layer_ropes)
        assert len(ropes) <= 1, "hybrids here use one rotary embedding for every layer"
        self.use_rope = bool(ropes)
        if ropes:
            self.register_buffer(
                "inv_freq", inv_freq(ropes.pop(), config.head_dim), persistent=False
            )

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> dict[int, torch.Tensor]:
        """Zeroed attention pool slots laid out as `KVLayout`, per attention layer."""
        cfg = self.config
        shape = (num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = dtype or self.model.embed_tokens.weight.dtype
        layers = self.attention_group
        pool = [
            torch.zeros(shape, dtype=dtype) for _ in range(1 + max(self._slots(False), default=-1))
        ]
        return {i: pool[self.slots[(i, False)]] for i in layers}

    def allocate_state_caches(
        self, num_blocks: int, dtype: torch.dtype | None = None
    ) -> dict[int, MambaCache]:
        """Zeroed Mamba state slots (block ids index them as in the KV pool), per Mamba layer."""
        s = self.config.mamba
        assert s is not None
        dtype = dtype or self.model.embed_tokens.weight.dtype
        pool = [
            MambaCache(
                torch.zeros(num_blocks, s.conv_dim, s.conv_kernel - 1, dtype=dtype),
                torch.zeros(num_blocks, s.num_heads, s.head_dim, s.state_size, dtype=dtype),
            )
            for _ in range(1 + max(self._slots(True), default=-1))
        ]
        return {i: pool[self.slots[(i, True)]] for i in self.state_group}

    def state_views(self, slot: torch.Tensor) -> MambaCache:
        """A Mamba layer's view of one flat pool slot [num_blocks, page elements]: each page's
        bytes, as the model's dtype whatever the KV dtype (an 8-bit KV pool's pages hold bfloat16
        states), start with the conv state [conv_dim, K − 1], then the SSM state [heads,
        head_dim, N] (architecture.md §Pages); rows stride one page, nothing is copied."""
        s = self.config.mamba
        assert s is not None
        dtype = self.model.embed_tokens.weight.dtype
        size = torch.empty((), dtype=dtype).element_size()
        page_bytes = slot.shape[-1] * slot.element_size() if slot.dim() == 2 else 0
        if slot.dim() != 2 or slot.stride(1) != 1 or page_bytes % size:
            raise ValueError(
                f"a Mamba layer's pool slot must be [num_blocks, page elements] with rows of a "
                f"whole number of {dtype} elements, got {tuple(slot.shape)} of {slot.dtype}"
            )
        slot = slot.view(dtype)  # the same bytes: [num_blocks, page_bytes / size]
        c, n = s.conv_state_elems, s.ssm_state_elems
        if slot.shape[1] < c + n:
            raise ValueError(f"a page of {slot.shape[1]} elements cannot hold a state of {c + n}")
        nb = slot.shape[0]
        conv = slot[:, :c].view(nb, s.conv_dim, s.conv_kernel - 1)
        ssm = slot[:, c : c + n].view(nb, s.num_heads, s.head_dim, s.state_size)
        return MambaCache(conv, ssm)

    def _slots(self, is_state: bool) -> list[int]:
        return [s for (_, state), s in self.slots.items() if state == is_state]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Mapping[int, torch.Tensor],
        attn_metadata: AttentionMetadata,
        state_caches: Mapping[int, MambaCache],
        state_metadata: StateMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] → final hidden states [num_tokens, hidden].

        Attention layers write this forward's K/V through the metadata's slot mappings; Mamba
        layers read and write their states at the slots `state_metadata` names per group."""
        cfg, device = self.config, input_ids.device
        group_size = cfg.num_heads // cfg.num_kv_heads
        attn_plans = {
            g: plan_group(attn_metadata, g, kind, cfg.num_kv_heads, group_size).to(device)
            for g, kind in self.group_kinds.items()
        }
        state_plans = {g: state_metadata.plan(g).to(device) for g in set(self.state_group.values())}
        h = self.model.embed_tokens(input_ids) * self.spec.embedding_multiplier
        if self.use_rope:
            inv = self.get_buffer("inv_freq")
            rope = rope_tables(inv.float(), positions, h.dtype)
        else:  # no position embedding: the identity rotation (cos 1, sin 0) is exact
            ones = h.new_ones(h.shape[0], 1, cfg.head_dim)
            rope = (ones, torch.zeros_like(ones))
        for i, layer in enumerate(self.model.layers):
            g, m = self.attention_group.get(i), self.state_group.get(i)
            h = layer(
                h,
                rope,
                kv_caches.get(i),
                None if g is None else attn_plans[g],
                state_caches.get(i),
                None if m is None else state_plans[m],
            )
        hidden: torch.Tensor = self.model.norm(h)
        return hidden

    def compute_logits(
        self, hidden_states: torch.Tensor, token_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] of the selected rows of `hidden_states` (all rows when None)."""
        if token_indices is not None:
            hidden_states = hidden_states[token_indices]
        return F.linear(hidden_states, self.lm_head.weight) * self.spec.logits_multiplier
