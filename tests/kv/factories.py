"""One-line factories for the kv tests (no fixtures: each test builds exactly what it reads)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from kvtier.kv import BlockPool, FullAttention, KVBlock, KVCacheManager, KVSequence, KVSpec

_fresh = itertools.count(1_000_000)


def pool(num_blocks: int = 11, **kwargs: Any) -> BlockPool:
    return BlockPool(num_blocks, **kwargs)


def manager(
    num_blocks: int = 11, specs: list[KVSpec] | None = None, max_model_len: int = 16384, **kw: Any
) -> KVCacheManager:
    return KVCacheManager(
        specs or [FullAttention(16)], num_blocks, max_model_len=max_model_len, **kw
    )


def fresh_tokens(n: int) -> list[int]:
    """`n` token ids that match nothing else built by this module (ids are never reused)."""
    return [next(_fresh) for _ in range(n)]


def admit(m: KVCacheManager, req_id: str, tokens: list[int], **kw: Any) -> KVSequence:
    """Look up, allocate the whole prompt (hits included), mark it computed; asserts success."""
    seq = m.new_sequence(req_id, tokens, **kw)
    hits, num_hit = m.get_computed_blocks(seq)
    new = m.allocate_slots(
        seq, len(tokens) - num_hit, num_new_computed_tokens=num_hit, new_computed_blocks=hits
    )
    assert new is not None, req_id
    seq.num_computed_tokens = len(tokens)
    return seq


def ids(blocks: Iterable[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]
