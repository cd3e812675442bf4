"""Records of the store planner: candidates, in-flight stores, per-request store state, and the
lazy-mode scan of the device LRU head. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.kv.block import BlockHash, KVBlock
from kvtier.offload.types import Key, Transfer
from kvtier.sched.request import Request

if TYPE_CHECKING:
    from kvtier.offload.tier import HostTier


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


def lazy_candidates(tier: HostTier, scan_blocks: int) -> list[Candidate]:
    """Hashed device blocks near the head of the device free queue (the next to be evicted there)
    whose content the host tier neither holds nor is storing.

    The candidates planned leave the queue while their copy runs, so the blocks behind them move
    up to the head: the scan goes on until it has passed `scan_blocks` blocks that *stay* in the
    queue (unhashed, already on the host or being stored, or beyond the host's free room), so the
    next `scan_blocks` blocks an allocation takes hold nothing the host tier could have kept.
    Candidates past the host's room are returned too (the caller counts them as skipped).
    """
    cands: list[Candidate] = []
    seen: set[Key] = set()
    room = tier.host.num_free
    kept = 0
    for db in tier.device.pool.free_queue:
        if kept >= scan_blocks:
            break
        h = db.block_hash
        if h is None:
            kept += 1
            continue
        key = (db.group_id, h)
        if key in seen or key in tier._store_keys or tier.host.contains(key):
            kept += 1
            continue
        seen.add(key)
        cands.append(Candidate(db.group_id, -1, db, key, None))
        if len(cands) > room:
            kept += 1  # no host block for it: it stays in the queue
    return cands
