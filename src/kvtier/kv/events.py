"""KV cache events emitted by a block pool (stored / removed / cleared), drained by `take_events`."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.ids import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]  # newly cached blocks, in chain order
    parent_block_hash: BlockHash | None  # hash of the block before the first one, if any
    token_ids: list[int]  # tokens covered by the new blocks
    block_size: int
    group_id: int
    medium: str  # "device", "host", ...


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    group_id: int
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
