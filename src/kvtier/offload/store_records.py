"""Records of the store planner: candidates, in-flight stores and per-request store state.
Plain data; `StorePlanner` (stores.py) owns every instance. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.ids import BlockHash, BlockId
from kvtier.kv.block import KVBlock
from kvtier.offload.types import Key, Transfer
from kvtier.sched.request import Request


@dataclass(slots=True)
class Candidate:
    group_id: int
    position: int
    device_block: KVBlock
    key: Key
    parent: BlockHash | None


@dataclass(slots=True)
class StoreRecord:
    transfer: Transfer
    host_blocks: list[KVBlock]  # allocated (ref 1), published only on completion
    device_blocks: list[KVBlock]  # one device pin each
    cands: list[Candidate]
    reports: int = 0
    abandoned: bool = False  # reset while in flight: release without publishing


@dataclass(slots=True)
class ReqState:
    request: Request
    cursor: list[int]  # per group: absolute position below which every block was visited
    keys: dict[Key, int] = field(default_factory=dict)  # stored/cached key -> position
    lost: set[tuple[int, int]] = field(default_factory=set)  # (group, position) evicted
    restored: set[tuple[int, int]] = field(default_factory=set)  # re-stored once: never again
    transfers: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StoreProgress:
    """A snapshot of one request's eager store state (`HostTier.store_progress`)."""

    cursor: tuple[int, ...]  # per group: every position below it was stored, cached or null
    lost: frozenset[tuple[int, int]]  # (group, position) evicted from the host, to re-store
    num_in_flight: int  # its stores not yet completed
    finished: bool  # the request ended; the state goes once its stores complete


@dataclass(frozen=True, slots=True)
class Published:
    """A host block an eager store just published, for the tiers below the host to demote
    (`HostTier.take_published`): its key, place in its request's chain and host block."""

    group_id: int
    position: int  # table position in the request's chain
    block_hash: BlockHash
    host_block_id: BlockId
    chain: Sequence[BlockHash]  # the request's hashes in this group's view (chain_tag source)
    token_ids: tuple[int, ...] | None = None  # its tokens, when the pools emit events
