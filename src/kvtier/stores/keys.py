"""What names a KV block outside the process: the layout it was written with and its place in a
prefix chain. A key never matches a block of another model, dtype, block size, layout version or
KV group, so a store shared across restarts or replicas cannot hand back another layout's bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

BlockHash = bytes  # the chained hash of a full block's tokens, as `kv/hashing.py` computes it

# Blocks of one chain segment share a Redis Cluster hash tag (one slot, one MGET); see
# `chain_keys`. 64 blocks of 16 tokens cover 1,024 tokens.
SEGMENT_BLOCKS = 64

_FINGERPRINT = re.compile(r"^[0-9a-f]{8,64}$")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """Everything besides the block hash that must match for stored bytes to be loadable.

    `model_fingerprint`: hex digest of the model (`stores.fingerprint.model_fingerprint`);
    `layout_version`: version of the byte layout of a block's payload, bumped by whoever changes
    that layout; `dtype`: the KV cache dtype name; `block_size`: tokens per block.
    """

    model_fingerprint: str
    layout_version: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if not _FINGERPRINT.match(self.model_fingerprint):
            raise ValueError(
                f"model_fingerprint must be 8-64 lowercase hex digits, got "
                f"{self.model_fingerprint!r}; compute it with stores.model_fingerprint(folder)"
            )
        if not 0 <= self.layout_version < 1 << 16:
            raise ValueError(f"layout_version must lie in [0, 65536), got {self.layout_version}")
        if not _DTYPE.match(self.dtype):
            raise ValueError(f"dtype must be a dtype name like 'bfloat16', got {self.dtype!r}")
        if not 1 <= self.block_size < 1 << 32:
            raise ValueError(f"block_size must be a positive 32-bit int, got {self.block_size}")

    def key(self, group: int, block_hash: BlockHash, chain_tag: BlockHash) -> StoreKey:
        """The key of one block of KV group `group` (see `StoreKey`)."""
        return StoreKey(self, group, block_hash, chain_tag)


@dataclass(frozen=True, slots=True)
class StoreKey:
    """One stored block: its layout, KV group and chained hash.

    `chain_tag` is the hash of the first block of the chain segment this block belongs to
    (`chain_keys`); it only decides placement (the Redis Cluster hash slot), never identity: the
    chained `block_hash` already names the whole prefix.
    """

    layout: StoreLayout
    group: int
    block_hash: BlockHash
    chain_tag: BlockHash

    def __post_init__(self) -> None:
        if not 0 <= self.group < 1 << 16:
            raise ValueError(f"group must lie in [0, 65536), got {self.group}")
        if not self.block_hash or not self.chain_tag:
            raise ValueError("block_hash and chain_tag must be non-empty bytes")

    @property
    def name(self) -> str:
        """The key as a string: `kvt1:{fingerprint:tag}:v1:bfloat16:b16:g0:<hash>`. The braces are
        a Redis Cluster hash tag: only the fingerprint and the segment tag choose the slot."""
        lay = self.layout
        fp = lay.model_fingerprint[:16]
        return (
            f"kvt1:{{{fp}:{self.chain_tag.hex()}}}:v{lay.layout_version}:{lay.dtype}"
            f":b{lay.block_size}:g{self.group}:{lay.model_fingerprint}:{self.block_hash.hex()}"
        )

    def digest(self) -> bytes:
        """16 bytes naming this key (a file name on disk, a check inside every stored frame)."""
        return xxhash.xxh3_128_digest(self.name.encode())


def chain_keys(
    layout: StoreLayout,
    group: int,
    block_hashes: Sequence[BlockHash],
    start: int = 0,
    segment_blocks: int = SEGMENT_BLOCKS,
) -> list[StoreKey]:
    """Keys of `block_hashes[start:]`, the chained hashes of one request from its first block.

    Block i is tagged with the hash of block `(i // segment_blocks) * segment_blocks`, so the
    blocks of one segment share a Redis Cluster slot (a batch within it is one MGET), while long
    chains spread over slots instead of piling every conversation that shares a first block onto
    one shard.
    """
    if segment_blocks < 1:
        raise ValueError(f"segment_blocks must be at least 1, got {segment_blocks}")
    if not 0 <= start <= len(block_hashes):
        raise ValueError(f"start must lie in [0, {len(block_hashes)}], got {start}")
    return [
        layout.key(group, block_hashes[i], block_hashes[(i // segment_blocks) * segment_blocks])
        for i in range(start, len(block_hashes))
    ]
