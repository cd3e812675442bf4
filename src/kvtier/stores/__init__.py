"""Byte-level block stores under the disk and remote KV tiers: the `BlockStore` protocol, keys
that name model, layout, dtype, block size and group (`keys.py`), the checked frame every stored
block is wrapped in (`frame.py`), `DiskStore` (files in a folder), `RedisStore` (Redis or Valkey,
standalone or Cluster), their counters (`metrics.py`) and the model fingerprint. Torch-free; imports
nothing of kvtier (architecture.md §Layers). `RedisStore` needs the optional redis client, so it is
imported from `kvtier.stores.redis_store` by whoever configures a remote tier, never from here."""

from kvtier.stores.base import BlockStore
from kvtier.stores.disk import DiskStore
from kvtier.stores.fingerprint import model_fingerprint
from kvtier.stores.frame import CorruptFrame, decode_frame, encode_frame
from kvtier.stores.keys import SEGMENT_BLOCKS, StoreKey, StoreLayout, chain_keys
from kvtier.stores.metrics import Histogram, StoreMetrics, StoreStats

__all__ = [
    "SEGMENT_BLOCKS",
    "BlockStore",
    "CorruptFrame",
    "DiskStore",
    "Histogram",
    "StoreKey",
    "StoreLayout",
    "StoreMetrics",
    "StoreStats",
    "chain_keys",
    "decode_frame",
    "encode_frame",
    "model_fingerprint",
]
