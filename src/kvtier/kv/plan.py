"""The byte plan: KV-cache groups from a model's layers, bytes per block, blocks for a budget, and
max concurrency at a length — with the same sizing formula runtime admission uses (`specs.py`).

A block id names one page in each layer slot of every group. An attention page holds K and V of
`block_size` tokens, a state page one Mamba layer's conv and SSM state; the slot page is the larger
of the two, so a hybrid's block size is raised until an attention page holds a state page."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvtier.config import DTYPE_BYTES, CacheConfig, ModelConfig, SchedulerConfig
from kvtier.kv.coordinator import check_alignment
from kvtier.kv.specs import (
    SHARED,
    AdmissionPolicy,
    ChunkedLocal,
    FullAttention,
    KVSpec,
    Mamba,
    SlidingWindow,
    admission_policy,
    blocks_for_requests,
    cdiv,
    max_concurrency,
)

GIB = 1 << 30


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table (same spec); `layer_indices` fill the group's slots."""

    spec: KVSpec
    layer_indices: tuple[int, ...]


@dataclass(frozen=True)
class TierPlan:
    name: str  # "device", "host"
    num_blocks: int  # including the null block
    bytes_per_block: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KVPlan:
    """Layout shared by every tier: a block id is one page in each of `layers_per_group` slots."""

    groups: tuple[KVGroup, ...]
    block_size: (
        int  # tokens per block: the requested size, raised for hybrids (`hybrid_block_size`)
    )
    layers_per_group: int  # slots per block id; groups with fewer layers leave slots unused
    page_bytes: int  # one slot's page: the larger of an attention page and a state page
    max_model_len: int
    max_in_flight_tokens: int
    tiers: tuple[TierPlan, ...]
    admission: AdmissionPolicy = SHARED  # what sizing and admission charge (--admission)
    attention_page_bytes: int = 0  # one attention layer's K and V for one block (0: none)
    state_page_bytes: int = 0  # one Mamba layer's conv + SSM state, one per block (0: none)
    requested_block_size: int = 0  # --block-size

    @property
    def specs(self) -> list[KVSpec]:
        return [g.spec for g in self.groups]

    @property
    def bytes_per_block(self) -> int:
        return self.layers_per_group * self.page_bytes

    @property
    def padding_fraction(self) -> float:
        """Share of slot memory left unused: by groups with fewer layers than slots, and by pages
        of the smaller kind (attention or state) in a slot page sized for the larger."""
        used = sum(len(g.layer_indices) * self.group_page_bytes(g) for g in self.groups)
        return 1.0 - used / (len(self.groups) * self.layers_per_group * self.page_bytes)

    def group_page_bytes(self, group: KVGroup) -> int:
        """Bytes one layer of `group` uses of its slot page."""
        return self.state_page_bytes if isinstance(group.spec, Mamba) else self.attention_page_bytes

    def blocks_per_request(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` needs, its share of the transient reserve included."""
        return self.blocks_for_requests(1, num_tokens)

    def blocks_for_requests(self, num_requests: int, num_tokens: int) -> int:
        """Blocks `num_requests` requests of `num_tokens` need under the plan's admission."""
        f, policy = self.max_in_flight_tokens, self.admission
        return blocks_for_requests(
            self.specs, num_requests, num_tokens, f, policy, self.max_model_len
        )

    def max_concurrency(self, tier: str = "device", num_tokens: int | None = None) -> int:
        """Requests of `num_tokens` (default max_model_len) that `tier` holds at once, as
        runtime admission charges them."""
        n = self.max_model_len if num_tokens is None else num_tokens
        blocks = next(t.num_blocks for t in self.tiers if t.name == tier)
        f, policy = self.max_in_flight_tokens, self.admission
        return max_concurrency(self.specs, blocks - 1, n, f, policy, self.max_model_len)


def layer_spec(
    model: ModelConfig, kind: str, block_size: int, state_block_size: int | None = None
) -> KVSpec:
    if kind == "full":
        return FullAttention(block_size)
    if kind == "sliding":
        assert model.sliding_window is not None
        return SlidingWindow(block_size, model.sliding_window)
    if kind == "chunked":
        assert model.attention_chunk_size is not None
        return ChunkedLocal(block_size, model.attention_chunk_size)
    if kind == "mamba":
        return Mamba(state_block_size or block_size)
    raise ValueError(f"{model.source}: layer kind {kind!r} has no KV plan")


def group_layers(
    model: ModelConfig, block_size: int, state_block_size: int | None = None
) -> tuple[tuple[KVGroup, ...], int]:
    """Split cache layers (`ModelConfig.cache_layers`: attention and Mamba mixers) into groups of
    equal slot count (the smallest kind's layer count), full attention first. State groups use
    `state_block_size` tokens per block (default `block_size`)."""
    by_spec: dict[KVSpec, list[int]] = defaultdict(list)
    for i, kind in model.cache_layers():
        by_spec[layer_spec(model, kind, block_size, state_block_size)].append(i)
    slots = min(len(v) for v in by_spec.values())
    groups: list[KVGroup] = []
    ordered = sorted(by_spec.items(), key=lambda kv: not isinstance(kv[0], FullAttention))
    for spec, layers in ordered:
        for start in range(0, len(layers), slots):
            groups.append(KVGroup(spec, tuple(layers[start : start + slots])))
    return tuple(groups), slots


def plan_kv(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig) -> KVPlan:
    """Compute the plan; raises ValueError naming the flag to change if no request fits."""
    dtype = cache.kv_dtype(model.dtype)
    block_size = hybrid_block_size(model, cache.block_size, dtype)
    kinds = {kind for _, kind in model.cache_layers()}
    attention_page = 2 * block_size_bytes(model, block_size, dtype) if kinds != {"mamba"} else 0
    state_page = state_page_bytes(model) if "mamba" in kinds else 0
    page_bytes = max(attention_page, state_page)
    max_model_len = sched.max_model_len or model.max_position_embeddings
    # Without prefix caching a state group needs one page per request for its whole life, updated
    # in place: one table position (architecture.md §Snapshots).
    state_block = block_size if cache.enable_prefix_caching else max_model_len
    groups, slots = group_layers(model, block_size, state_block)
    check_alignment([g.spec for g in groups])  # what the engine's coordinator will refuse
    bytes_per_block = slots * page_bytes
    if cache.num_device_blocks is not None:
        device_blocks = cache.num_device_blocks
    elif cache.kv_cache_memory_bytes is not None:
        device_blocks = cache.kv_cache_memory_bytes // bytes_per_block
    else:
        raise ValueError(
            "give a device KV budget: --num-device-blocks N or --kv-cache-memory-bytes"
        )
    tiers = [TierPlan("device", device_blocks, bytes_per_block)]
    if cache.num_host_blocks is not None:
        tiers.append(TierPlan("host", cache.num_host_blocks, bytes_per_block))
    elif cache.kv_offloading_size:
        host_blocks = int(cache.kv_offloading_size * GIB) // bytes_per_block
        if host_blocks < 1:
            raise ValueError(
                f"--kv-offloading-size {cache.kv_offloading_size} GiB holds no KV block (one "
                f"block is {bytes_per_block} bytes): give at least {bytes_per_block / GIB:.3g} "
                "GiB, or --num-host-blocks N"
            )
        tiers.append(TierPlan("host", host_blocks, bytes_per_block))
    plan = KVPlan(
        groups,
        block_size,
        slots,
        page_bytes,
        max_model_len,
        sched.max_in_flight_tokens,
        tuple(tiers),
        admission=admission_policy(cache.admission, sched.max_num_batched_tokens),
        attention_page_bytes=attention_page,
        state_page_bytes=state_page,
        requested_block_size=cache.block_size,
    )
    need = plan.blocks_per_request(max_model_len)
    if device_blocks - 1 < need:
        fit = _longest_fitting(plan, device_blocks - 1)
        have = f"the device KV budget holds {device_blocks} blocks ({device_blocks * bytes_per_block / GIB:.3f} GiB)"
        more = (
            f"raise --num-device-blocks to ≥ {need + 1} or --kv-cache-memory-bytes to "
            f"≥ {(need + 1) * bytes_per_block}"
        )
        if fit == 0:
            raise ValueError(f"{have}, fewer than one per KV-cache group ({len(groups)}): {more}")
        raise ValueError(
            f"{have}, but one request of --max-model-len {max_model_len} needs {need} + 1 null "
            f"blocks under --admission {plan.admission.name}: {more}, or lower --max-model-len "
            f"to ≤ {fit}"
        )
    return plan


def block_size_bytes(model: ModelConfig, block_size: int, dtype: str) -> int:
    """Bytes of K (or V) of one layer for one block."""
    return block_size * model.num_kv_heads * model.head_dim * DTYPE_BYTES[dtype]


def state_page_bytes(model: ModelConfig) -> int:
    """Bytes of one Mamba layer's state (conv + SSM) for one request, kept in the model's dtype
    whatever the KV dtype (as vLLM's default Mamba cache dtype)."""
    assert model.mamba is not None
    return model.mamba.state_elems * DTYPE_BYTES[model.dtype]


def hybrid_block_size(model: ModelConfig, block_size: int, dtype: str) -> int:
    """`block_size`, or for a model with attention and Mamba layers the smallest multiple of it
    whose attention page holds a state page (vLLM's rule): with the requested size a state page
    can be tens of attention pages, and every attention page would be mostly padding."""
    kinds = {kind for _, kind in model.cache_layers()}
    if "mamba" not in kinds or kinds == {"mamba"}:
        return block_size
    attention_page = 2 * block_size_bytes(model, block_size, dtype)
    return block_size * cdiv(state_page_bytes(model), attention_page)


def _longest_fitting(plan: KVPlan, usable_blocks: int) -> int:
    """The longest --max-model-len at which one request fits in `usable_blocks`."""
    f, policy = plan.max_in_flight_tokens, plan.admission
    lo, hi = 0, plan.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for_requests(plan.specs, 1, mid, f, policy) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
