"""The memory a device owns: one KV tensor per layer slot and tier, plus named unpaged buffers,
and the check that an access set names only that memory. Allocation itself is the backend's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.config import DTYPE_BYTES
from kvtier.device.types import TIERS, WHOLE, AccessSet, KVLayout, Tier

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
}
assert set(TORCH_DTYPES) == set(DTYPE_BYTES)  # the plan sizes only what a buffer holds

Alloc = Callable[[tuple[int, ...], torch.dtype, Tier], torch.Tensor]


class Buffers:
    """KV tiers and named buffers of one device; `alloc` is the backend's allocator."""

    def __init__(
        self, layout: KVLayout, num_device_blocks: int, num_host_blocks: int, alloc: Alloc
    ) -> None:
        for name, value in (
            ("num_device_blocks", num_device_blocks),
            ("num_host_blocks", num_host_blocks),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self._alloc = alloc
        self._num_blocks: dict[str, int] = {"device": num_device_blocks, "host": num_host_blocks}
        self._named: dict[str, torch.Tensor] = {}
        dtype = TORCH_DTYPES[layout.dtype]
        # One flat tensor per layer slot and tier: [num_blocks, page elements]. Attention views
        # a page as [2, block_size, num_kv_heads, head_dim], a state layer as conv + SSM state.
        self._kv: dict[str, list[torch.Tensor]] = {
            tier: [
                alloc(layout.page_shape(self._num_blocks[tier]), dtype, tier)
                for _ in range(layout.num_layer_slots)
            ]
            for tier in TIERS
        }

    def kv(self, tier: Tier) -> list[torch.Tensor]:
        """The KV tensors of `tier`, one per layer slot: [num_blocks, page elements]."""
        if tier not in self._kv:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        return self._kv[tier]

    def num_blocks(self, tier: Tier) -> int:
        """Number of blocks in `tier`'s KV pool."""
        self.kv(tier)
        return self._num_blocks[tier]

    def add(self, name: str, shape: Sequence[int], dtype: str, tier: Tier) -> torch.Tensor:
        """Allocate the named buffer `name` of `shape` (zeros) on `tier` and return it."""
        if name in self._named or name in self._kv:
            raise ValueError(f"buffer name {name!r} is taken; pick another name")
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
        self.kv(tier)
        tensor = self._alloc(tuple(shape), TORCH_DTYPES[dtype], tier)
        self._named[name] = tensor
        return tensor

    def get(self, name: str) -> torch.Tensor:
        """The named buffer `name`."""
        if name not in self._named:
            raise ValueError(f"no buffer named {name!r}; allocate it with alloc_buffer first")
        return self._named[name]

    def check_access(self, access: AccessSet) -> None:
        """Raise ValueError unless every access names a tier block in range or a whole buffer."""
        for name, ids in (*access.reads, *access.writes):
            size = self._num_blocks.get(name)
            if size is not None:
                if ids and (min(ids) < 0 or max(ids) >= size):
                    raise ValueError(
                        f"access to {name!r} blocks {list(ids)} is out of range [0, {size})"
                    )
            elif name not in self._named:
                raise ValueError(
                    f"access names unknown buffer {name!r}; use a tier {TIERS} or alloc_buffer"
                )
            elif ids != (WHOLE,):
                raise ValueError(
                    f"buffer {name!r} is unpaged: declare it as {{{name!r}: None}}, not {ids}"
                )
