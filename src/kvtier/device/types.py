"""Torch-free records of the device layer: tiers and streams, the KV layout, op metadata and access
sets (the id types are `kvtier.ids`'s).

Shared by the sanitizer (which must never import torch) and every backend; holds no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from kvtier.config import DTYPE_BYTES
from kvtier.ids import BlockId, ReqId, StreamId

Tier = Literal["device", "host"]

TIERS: tuple[Tier, ...] = ("device", "host")
HOST_STREAM = StreamId(-1)  # the host as an actor in the sanitizer, traces and hazard reports
COMPUTE = StreamId(0)
LOAD = StreamId(1)
STORE = StreamId(2)
DEFAULT_STREAMS: dict[StreamId, str] = {COMPUTE: "compute", LOAD: "load", STORE: "store"}
WHOLE: BlockId = -1  # the one "block" of a named, unpaged buffer (e.g. "sampled_tokens")

# 8-bit pools hold fp8 codes (docs/kernels.md, "8-bit KV"); every copy between tiers moves bytes
FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One KV pool: `num_layer_slots` tensors, each [num_blocks, page elements] of `dtype`: one
    page of `page_bytes` per block id and slot (architecture.md §Pages).

    A block id indexes the same page in every layer slot; the device and host tiers share the
    layout and differ only in `num_blocks`. An attention layer views its slot as
    `slot_shape` [num_blocks, 2, block_size, heads, dim]; a state (Mamba) layer views the same
    bytes as its conv and SSM state. `page_bytes` 0 means an attention page.
    """

    num_layer_slots: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    page_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layer_slots", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(FLOAT_DTYPES)}, got {self.dtype!r}"
            )
        page, elem = self.page_bytes, DTYPE_BYTES[self.dtype]
        if not isinstance(page, int) or page < 0 or page % elem:
            raise ValueError(
                f"KVLayout.page_bytes must be an int ≥ 0 and a multiple of {elem} ({self.dtype} "
                f"elements), got {page!r}"
            )

    @property
    def attention_page_bytes(self) -> int:
        """Bytes of K and V of one block in one layer slot."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def slot_page_bytes(self) -> int:
        """Bytes of one block's page in one layer slot."""
        return self.page_bytes or self.attention_page_bytes

    def page_shape(self, num_blocks: int) -> tuple[int, int]:
        """Shape of one layer slot's tensor holding `num_blocks` pages (elements of `dtype`)."""
        return (num_blocks, self.slot_page_bytes // DTYPE_BYTES[self.dtype])

    def slot_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Attention's view of one layer slot holding `num_blocks` blocks (the page must be an
        attention page: a hybrid's block size is raised until it is, kv/plan.py)."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block summed over all layer slots (what one block copy moves)."""
        return self.slot_page_bytes * self.num_layer_slots


@dataclass(frozen=True, slots=True)
class OpMeta:
    """Who launched an op, for traces and hazard reports: a label, the step and its requests."""

    label: str
    step_seq: int | None = None
    req_ids: tuple[ReqId, ...] = ()

    def describe(self) -> str:
        """Label, step and requests as one short phrase for reports."""
        parts = [repr(self.label)]
        if self.step_seq is not None:
            parts.append(f"step {self.step_seq}")
        if self.req_ids:
            parts.append("reqs " + ",".join(self.req_ids))
        return " ".join(parts)


BufferAccess: TypeAlias = tuple[str, tuple[BlockId, ...]]


@dataclass(frozen=True, slots=True)
class AccessSet:
    """The blocks an op declares it reads and writes, as (buffer name, block ids) pairs.

    Paged KV buffers are named by tier ("device", "host"); a named unpaged buffer is accessed as
    the single block `WHOLE`. An op that reads and writes one block lists it in `writes` only
    (listing it in both is allowed and means the same).
    """

    reads: tuple[BufferAccess, ...] = ()
    writes: tuple[BufferAccess, ...] = ()

    @classmethod
    def of(
        cls,
        reads: Mapping[str, Iterable[BlockId] | None] | None = None,
        writes: Mapping[str, Iterable[BlockId] | None] | None = None,
    ) -> AccessSet:
        """Build from {buffer: block ids}; `None` block ids mean the whole unpaged buffer."""
        return cls(_pairs(reads), _pairs(writes))

    def buffers(self) -> set[str]:
        """Names of every buffer the op touches."""
        return {name for name, _ in self.reads} | {name for name, _ in self.writes}

    def num_blocks(self) -> int:
        """Number of (buffer, block) accesses declared, counting reads and writes."""
        return sum(len(ids) for _, ids in self.reads) + sum(len(ids) for _, ids in self.writes)


def _pairs(spec: Mapping[str, Iterable[BlockId] | None] | None) -> tuple[BufferAccess, ...]:
    if not spec:
        return ()
    return tuple((name, (WHOLE,) if ids is None else tuple(ids)) for name, ids in spec.items())
