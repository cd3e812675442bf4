"""What a lookup asks the tiers below the host for, and the I/O job that asks them.

The chain (`chain.py`) builds a `FetchJob` on the engine thread from a waiting request: its chained
hashes per group, the boundary the device and host already serve (`start`) and which blocks beyond
it the host holds. `run_fetch` runs on an I/O thread and touches only the stores (every
`BlockStore` is thread-safe): it walks the tiers in order, each asked only for what the tiers above
lack, and returns the largest aligned boundary at which every group finds each block a step
starting there reads (architecture.md §H6), with the payloads of the blocks the host lacks there.
Full-attention groups bound that boundary first; window and state groups are then asked only for
the blocks a step starting near it reads. A store's miss, error or timeout is only a shorter hit.
Torch-free; imports no device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.ids import BlockHash, ReqId
from kvtier.kv.specs import FullAttention, KVSpec
from kvtier.offload.lookup import needed_positions
from kvtier.stores import SEGMENT_BLOCKS, BlockStore, StoreKey, StoreLayout

log = logging.getLogger("kvtier.offload")

Pos = tuple[int, int]  # (KV-cache group, table position)
# Boundaries below the full groups' bound that window and state groups are asked to serve.
WINDOW_SEARCH_STEPS = 8


@dataclass(frozen=True, slots=True)
class LowerTier:
    """One tier below the host: a name for metrics, its store, and whether `contains` answers
    from memory (the disk: ask it first and read only the blocks the boundary needs) or costs a
    round trip (Redis: `get` at once, a miss is a nil)."""

    name: str
    store: BlockStore
    cheap_contains: bool


@dataclass(frozen=True, slots=True)
class Want:
    """One block the host lacks: its place, its store key and its chain parent (full groups)."""

    group: int
    position: int
    key: StoreKey
    parent: BlockHash | None


@dataclass(frozen=True, slots=True)
class FetchJob:
    """One request's lookup below the host (built on the engine thread; read-only after)."""

    req_id: ReqId
    device_hit: int  # tokens the device serves
    start: int  # tokens the device and host serve (a multiple of `align`)
    max_len: int  # the most tokens a hit may reach (a multiple of `align`)
    views: list[Sequence[BlockHash]]  # per group: the request's chained hashes (a copy)
    held: frozenset[Pos]  # positions ≥ start whose block the host held or was storing
    layouts: list[StoreLayout]  # per group
    token_ids: tuple[int, ...] = ()  # the request's tokens up to max_len, when tiers emit events

    def tokens(self, g: int, p: int, block_size: int) -> tuple[int, ...] | None:
        """The tokens of group `g`'s block at position `p` (None: not kept)."""
        end = (p + 1) * block_size
        return self.token_ids[p * block_size : end] if len(self.token_ids) >= end else None

    def want(self, g: int, p: int) -> Want:
        view = self.views[g]
        tag = view[(p // SEGMENT_BLOCKS) * SEGMENT_BLOCKS]
        parent = view[p - 1] if p > 0 else None
        return Want(g, p, self.layouts[g].key(g, view[p], tag), parent)


@dataclass(slots=True)
class FetchResult:
    """What `run_fetch` found. `boundary` ≤ `start`: nothing beyond the host's hit."""

    start: int  # the job's start and max_len
    max_len: int
    boundary: int
    found: list[tuple[Want, bytes, int]]  # blocks the host lacks at the boundary: payload, tier
    reach: list[int]  # per tier: the boundary the host and the tiers down to it reach
    asked: list[bool]  # per tier: whether it was asked anything
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def reach(
    specs: Sequence[KVSpec],
    align: int,
    device_hit: int,
    start: int,
    limit: int,
    has: Callable[[int, int], bool],
) -> int:
    """The largest B in (start, limit], a multiple of `align`, at which every group `has` each
    block a step starting at B reads beyond the device hit; `start` when there is none."""
    b = limit // align * align
    for g, spec in enumerate(specs):  # prefix-closed groups bound B in one scan
        if isinstance(spec, FullAttention):
            bs, p = spec.block_size, start // spec.block_size
            while p < b // bs and has(g, p):
                p += 1
            b = min(b, p * bs // align * align)
    others = [(g, s) for g, s in enumerate(specs) if not isinstance(s, FullAttention)]
    while b > start:
        if all(has(g, p) for g, s in others for p in needed_positions(s, device_hit, b)):
            return b
        b -= align
    return start


class _Walk:
    """The state of one `run_fetch`: what each tier said it has, and the payloads read."""

    def __init__(self, job: FetchJob, specs: Sequence[KVSpec], tiers: Sequence[LowerTier]):
        self.job, self.specs, self.tiers = job, specs, tiers
        self.present: dict[Pos, int] = {}  # position -> index of the first tier holding it
        self.payload: dict[Pos, bytes] = {}
        self.asked = [False] * len(tiers)
        self.errors: list[str] = []

    def has(self, g: int, p: int, deepest: int | None = None) -> bool:
        if p < self.job.start // self.specs[g].block_size or (g, p) in self.job.held:
            return True
        t = self.present.get((g, p))
        return t is not None and (deepest is None or t <= deepest)

    def deepest(self, tier: int) -> Callable[[int, int], bool]:
        """`has` as if the tiers below `tier` were not there."""
        return lambda g, p: self.has(g, p, tier)

    def ask(self, wants: list[Want]) -> None:
        """Walk the tiers in order; each is asked for the wants no tier above it has."""
        for i, tier in enumerate(self.tiers):
            missing = [w for w in wants if (w.group, w.position) not in self.present]
            if not missing:
                return
            self.asked[i] = True
            keys = [w.key for w in missing]
            got: list[tuple[Want, bytes | None]]
            try:
                if tier.cheap_contains:
                    flags = tier.store.contains(keys)
                    got = [(w, None) for w, f in zip(missing, flags, strict=True) if f]
                else:
                    values = tier.store.get(keys)
                    got = [(w, v) for w, v in zip(missing, values, strict=True) if v is not None]
            except Exception as exc:  # a store must answer misses; never lose the lookup
                log.warning("%s tier: lookup failed: %r", tier.name, exc)
                self.errors.append(f"{tier.name}: {exc!r}")
                continue
            for w, value in got:
                self.present[(w.group, w.position)] = i
                if value is not None:
                    self.payload[(w.group, w.position)] = value

    def read(self, wants: list[Want]) -> bool:
        """Read the payloads tiers only reported holding; False if any read missed (then the
        position is no longer present)."""
        ok = True
        for i, tier in enumerate(self.tiers):
            todo = [
                w
                for w in wants
                if self.present.get((w.group, w.position)) == i
                and (w.group, w.position) not in self.payload
            ]
            if not todo:
                continue
            try:
                values = tier.store.get([w.key for w in todo])
            except Exception as exc:
                log.warning("%s tier: read failed: %r", tier.name, exc)
                self.errors.append(f"{tier.name}: {exc!r}")
                values = [None] * len(todo)
            for w, value in zip(todo, values, strict=True):
                if value is None:  # evicted, truncated or corrupt since contains said yes
                    del self.present[(w.group, w.position)]
                    ok = False
                else:
                    self.payload[(w.group, w.position)] = value
        return ok


def run_fetch(
    job: FetchJob, specs: Sequence[KVSpec], align: int, tiers: Sequence[LowerTier]
) -> FetchResult:
    """Ask `tiers` for the blocks beyond `job.start` (see the module docstring). Runs on an I/O
    thread; mutates nothing but the stores' own state (LRU order, counters)."""
    t0 = time.perf_counter()
    walk = _Walk(job, specs, tiers)
    full = [g for g, s in enumerate(specs) if isinstance(s, FullAttention)]
    wants = [
        job.want(g, p)
        for g in full
        for p in range(job.start // specs[g].block_size, job.max_len // specs[g].block_size)
        if (g, p) not in job.held
    ]
    walk.ask(wants)
    others = [g for g in range(len(specs)) if g not in full]
    # the full groups' bound: window and state groups are asked next, only for what it needs
    bound = reach(
        specs,
        align,
        job.device_hit,
        job.start,
        job.max_len,
        lambda g, p: g in others or walk.has(g, p),
    )
    if others and bound > job.start:
        lowest = max(job.start + align, bound - WINDOW_SEARCH_STEPS * align)
        more: list[Want] = []
        for g in others:
            spec = specs[g]
            first = needed_positions(spec, job.device_hit, lowest).start
            first = max(first, job.start // spec.block_size)
            more += [
                job.want(g, p)
                for p in range(first, bound // spec.block_size)
                if (g, p) not in job.held
            ]
        walk.ask(more)
        wants += more
    limit = job.max_len
    while True:
        boundary = reach(specs, align, job.device_hit, job.start, limit, walk.has)
        needed = [w for w in wants if _needed(specs[w.group], job, boundary, w.position)]
        if walk.read(needed):
            break
        limit = boundary  # a read missed: that position is gone, the boundary can only drop
    per_tier = [
        reach(specs, align, job.device_hit, job.start, job.max_len, walk.deepest(i))
        for i in range(len(tiers))
    ]
    found = [
        (w, walk.payload[(w.group, w.position)], walk.present[(w.group, w.position)])
        for w in needed
    ]
    seconds = time.perf_counter() - t0
    return FetchResult(
        job.start, job.max_len, boundary, found, per_tier, walk.asked, seconds, walk.errors
    )


def _needed(spec: KVSpec, job: FetchJob, boundary: int, position: int) -> bool:
    if boundary <= job.start:
        return False
    return position in needed_positions(spec, job.device_hit, boundary)
