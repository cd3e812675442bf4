"""Torch-free KV bookkeeping over integer block ids: pool, quarantine, hashing, managers, plan."""

from kvtier.ids import BlockHash, BlockId
from kvtier.kv.block import FreeBlockQueue, KVBlock
from kvtier.kv.block_pool import BlockPool, IntegrityError
from kvtier.kv.coordinator import GroupBlocks, KVCacheCoordinator
from kvtier.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.kv.hashing import BlockHasher, HashExtras, MultiModalItem, get_hash_fn
from kvtier.kv.manager import KVCacheManager, PrefixCacheStats
from kvtier.kv.request import KVSequence
from kvtier.kv.specs import (
    ChunkedLocal,
    FullAttention,
    KVSpec,
    Mamba,
    SlidingWindow,
    blocks_for_requests,
    cdiv,
    max_concurrency,
)
from kvtier.kv.stats import PoolStats

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ChunkedLocal",
    "FreeBlockQueue",
    "FullAttention",
    "GroupBlocks",
    "HashExtras",
    "IntegrityError",
    "KVBlock",
    "KVCacheCoordinator",
    "KVCacheManager",
    "KVEvent",
    "KVSequence",
    "KVSpec",
    "Mamba",
    "MultiModalItem",
    "PoolStats",
    "PrefixCacheStats",
    "SlidingWindow",
    "blocks_for_requests",
    "cdiv",
    "get_hash_fn",
    "max_concurrency",
]
