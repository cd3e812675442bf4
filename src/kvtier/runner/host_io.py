"""Host blocks as bytes for the tiers below the host: the payload of store layout version 1, read
and written in declared host ops (architecture.md §Chain).

Payload of one block, layout version 1: for each layer slot in slot order, that block's row of the
host tier's slot tensor (`Device.kv("host")[slot][block]`) in the KV dtype, native byte order
(little-endian on every supported machine). The same on the cpu, cuda and sim backends, whose host
tiers are plain (pinned) CPU tensors of one layout. Implements `offload.chain.HostBlockBytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.device import AccessSet, Device, OpMeta
from kvtier.ids import BlockId

LAYOUT_VERSION = 1


class HostBlockIO:
    """Reads and writes whole host blocks of `device` on the host thread; each call is one host
    op declaring its blocks, so the sanitizer checks it against every copy that touched them."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._slots = device.kv("host")
        self._row_bytes = [t[0].numel() * t.element_size() for t in self._slots]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload (every layer slot's row)."""
        return sum(self._row_bytes)

    def read(self, block_ids: Sequence[BlockId]) -> list[bytes]:
        """The payload of each host block (one host op reading them)."""
        ids = list(block_ids)
        out: list[bytes] = []

        def read() -> None:
            for b in ids:
                rows = [t[b].contiguous().view(-1).view(torch.uint8) for t in self._slots]
                out.append(torch.cat(rows).numpy().tobytes())

        access = AccessSet(reads=(("host", tuple(ids)),))
        self.device.host_op(read, access, OpMeta("tier-demote"))
        return out

    def write(self, block_ids: Sequence[BlockId], payloads: Sequence[bytes]) -> None:
        """Overwrite each host block with its payload (one host op writing them). ValueError for
        a payload that is not `block_bytes` long (nothing is written)."""
        ids = list(block_ids)
        if len(ids) != len(payloads):
            raise ValueError(f"{len(ids)} block ids for {len(payloads)} payloads")
        for p in payloads:
            if len(p) != self.block_bytes:
                raise ValueError(f"a payload of {len(p)} bytes; a block holds {self.block_bytes}")

        def write() -> None:
            for b, payload in zip(ids, payloads, strict=True):
                flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                offset = 0
                for t, n in zip(self._slots, self._row_bytes, strict=True):
                    t[b].view(-1).view(torch.uint8).copy_(flat[offset : offset + n])
                    offset += n

        access = AccessSet(writes=(("host", tuple(ids)),))
        self.device.host_op(write, access, OpMeta("tier-stage"))
