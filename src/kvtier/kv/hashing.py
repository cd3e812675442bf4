"""Chained block hashing over a canonical byte encoding, identical across processes and runs.

hash_i = H(parent_i ‖ len ‖ token ids as little-endian u32 ‖ extra keys), parent_0 = NONE_HASH.
Never uses Python's `hash()`. Extra keys (adapter, multimodal items, cache salt) go into the right blocks.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvtier.ids import BlockHash

HashFn = Callable[[bytes], bytes]

_NONE_SEED = b"kvtier:none-hash:v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=0)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": _sha256, "xxhash": _xxh3_128}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called `name`; raises ValueError naming the choices."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown prefix-caching hash {name!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashExtras:
    """Keys besides token ids that make otherwise equal blocks distinct."""

    cache_salt: str | None = None  # only in block 0; propagates through the chain
    adapter_name: str | None = None  # every block
    mm_items: tuple[MultiModalItem, ...] = ()  # blocks they overlap, with their offset in the block

    def encode(self, start: int, end: int) -> bytes:
        """Canonical bytes of the extra keys of the block covering token positions [start, end)."""
        parts: list[bytes] = []
        if self.adapter_name is not None:
            parts.append(b"A" + _str(self.adapter_name))
        for item in self.mm_items:
            if item.offset < end and item.offset + item.length > start:
                parts.append(b"M" + _str(item.identifier) + struct.pack("<q", item.offset - start))
        if self.cache_salt is not None and start == 0:
            parts.append(b"S" + _str(self.cache_salt))
        return b"".join(parts)


def _str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return struct.pack("<I", len(arr)) + arr.tobytes()


class BlockHasher:
    """Computes a sequence's chained hashes, one per full block of `block_size` tokens."""

    def __init__(self, block_size: int, hash_fn: str = "sha256") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_fn_name = hash_fn
        self._hash = get_hash_fn(hash_fn)
        self.none_hash: BlockHash = self._hash(_NONE_SEED)

    def hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
    ) -> BlockHash:
        """Hash of one block given its parent's hash (None for the first block)."""
        head = self.none_hash if parent is None else parent
        return self._hash(head + _token_bytes(token_ids) + extra)

    def extend(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        extras: HashExtras | None = None,
    ) -> None:
        """Append hashes for the full blocks of `token_ids` not yet in `block_hashes` (mutates)."""
        bs = self.block_size
        num_full = len(token_ids) // bs
        parent = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), num_full):
            start = i * bs
            extra = extras.encode(start, start + bs) if extras is not None else b""
            parent = self.hash_block(parent, token_ids[start : start + bs], extra)
            block_hashes.append(parent)
