"""TierChain: device → host → disk → remote as one `sched.connector.KVTier` (architecture.md
§Chain).

The host tier stays the only tier that copies to and from the device; the tiers below it (`fetch.py`
`LowerTier`: a `DiskStore`, a `RedisStore`) reach the device through host blocks:
- lookup: the host extends the device hit; if a lower tier may extend it further, an I/O thread
  asks the stores (`fetch.run_fetch`, kept in flight by `in_flight.py`) while the request waits
  (`wait_for_load`, its host hit pinned); once the answer is in, its blocks are written into host
  blocks (a declared host op of `HostBlockBytes`), published in the host cache, and the request's
  next lookup is an ordinary host hit, loaded on the load stream like any other. Past the deadline the request runs with what
  the host has; a miss, a corrupt block or a dead store is a shorter hit, recomputed.
- stores: every block an eager host store publishes is read (a declared host op) and queued to
  every lower tier (`BlockStore.put` never blocks; back-pressure drops); a block promoted from the
  remote tier is queued to the disk tier too.
Decides what a lookup asks below the host and what a landed read becomes; owns the lower tiers'
metrics and KV events; changes no request.
Torch-free: bytes of host blocks go through the `HostBlockBytes` protocol the runner implements.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvtier.ids import BlockHash, BlockId, ReqId
from kvtier.kv.events import BlockRemoved, BlockStored, KVEvent
from kvtier.kv.specs import FullAttention
from kvtier.offload.fetch import FetchJob, FetchResult, LowerTier, run_fetch
from kvtier.offload.in_flight import InFlightReads, Next
from kvtier.offload.store_records import Published
from kvtier.offload.tier import HostTier
from kvtier.offload.types import Key, Transfer
from kvtier.sched.connector import LoadFailure, TierLookup
from kvtier.sched.request import Request
from kvtier.stores import SEGMENT_BLOCKS, StoreKey, StoreLayout, StoreStats

_Block = tuple[StoreKey, BlockHash | None, Sequence[int] | None]  # key, parent, tokens (events)


class HostBlockBytes(Protocol):
    """Whole host blocks as bytes (the payload of store layout version 1), read and written in
    declared host ops so the device's sanitizer orders them with every copy. `runner/host_io.py`
    implements it; call only on the engine thread."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload."""
        ...

    def read(self, block_ids: Sequence[BlockId]) -> list[bytes]:
        """The payload of each host block."""
        ...

    def write(self, block_ids: Sequence[BlockId], payloads: Sequence[bytes]) -> None:
        """Overwrite each host block with its payload (each `block_bytes` long)."""
        ...


@dataclass(slots=True)
class LowerTierMetrics:
    """Counters of one tier below the host (beside its store's own `StoreStats`)."""

    num_queries: int = 0  # admitted lookups that asked this tier
    num_query_tokens: int = 0  # tokens asked of it (beyond what the tiers above served)
    num_hit_tokens: int = 0  # tokens of its blocks first loaded from the host by an admission
    num_preempted_hit_tokens: int = 0  # the same, by re-admissions after a preemption
    num_promoted_blocks: int = 0  # blocks read from it into host blocks
    num_promoted_bytes: int = 0
    num_demoted_blocks: int = 0  # blocks queued for writing into it
    num_demoted_bytes: int = 0
    num_dropped_blocks: int = 0  # demotions refused under back-pressure


@dataclass(slots=True)
class ChainMetrics:
    """Counters of the chain's fetches (all lower tiers together)."""

    num_fetches: int = 0  # I/O jobs started
    num_fetch_timeouts: int = 0  # lookups that stopped waiting at the deadline
    num_fetch_skipped: int = 0  # lookups that asked nothing: too many jobs in flight
    num_fetch_errors: int = 0  # jobs that raised or whose stores raised
    num_staged_blocks: int = 0  # blocks written into host blocks and published there
    num_bad_payloads: int = 0  # payloads of the wrong size (dropped)
    fetch_seconds: float = 0.0  # I/O time of the jobs, summed


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier below the host (`TierChain.tier_stats`)."""

    name: str
    metrics: LowerTierMetrics
    store: StoreStats


class TierChain:
    """The host tier and the tiers below it, as one `KVTier`.

    `lowers`: the tiers below the host, in lookup order (disk before remote). `io`: host-block
    bytes. `layouts`: the store layout of each KV-cache group. `timeout_s`: the longest a lookup
    waits for them in total, however many blocks it asks for. `max_fetches`: jobs in
    flight at most; more lookups skip the lower tiers. `clock`: seconds, monotonic.
    """

    def __init__(
        self,
        host: HostTier,
        lowers: Sequence[LowerTier],
        io: HostBlockBytes,
        layouts: Sequence[StoreLayout],
        *,
        timeout_s: float = 0.5,
        max_fetches: int = 8,
        num_io_threads: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(layouts) != len(host.specs):
            raise ValueError("layouts needs one StoreLayout per KV-cache group")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.host = host
        self.lowers = list(lowers)
        self.io = io
        self.layouts = list(layouts)
        self.specs = host.specs
        self.align = host.coordinator.alignment
        self.metrics = ChainMetrics()
        self.tier_metrics = {t.name: LowerTierMetrics() for t in self.lowers}
        self._reads = InFlightReads(timeout_s, max_fetches, num_io_threads, clock)
        # the group whose positions attribute tokens to tiers: the first full-attention group
        self._ref_group = next(
            (g for g, s in enumerate(self.specs) if isinstance(s, FullAttention)), 0
        )
        # KV events of the lower tiers (medium: the tier's name), with the host's: a block is
        # announced before its store is queued; a store reports, from its own threads, each key
        # it was given but does not hold (dropped, failed, evicted, deleted).
        self.emits_events = host.emits_events
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        if self.emits_events:
            for t in self.lowers:
                t.store.watch_removals(functools.partial(self._removed, t.name))

    @property
    def timeout_s(self) -> float:
        """The longest a lookup waits for the tiers below the host."""
        return self._reads.timeout_s

    # ---- lookup --------------------------------------------------------------------------------

    def lookup(self, request: Request, num_hit_tokens: int) -> TierLookup:
        """The host tier's answer, extended by the tiers below it once their blocks are staged
        in host blocks: `wait_for_load` while they are being read (the host hit stays pinned),
        until the deadline; then what the host has."""
        self._stage_done()
        answer = self.host.lookup(request, num_hit_tokens)
        if answer.wait_for_load or not self.lowers:
            return answer
        rid = request.request_id
        end = num_hit_tokens + answer.num_tokens
        todo = self._reads.begin(rid, request.num_tokens, (num_hit_tokens, end))
        if todo is Next.WAIT:
            return TierLookup(0, wait_for_load=True)
        if todo is Next.TIMED_OUT:
            self.metrics.num_fetch_timeouts += 1
        if todo is not Next.ASK:
            return answer
        max_len = (request.num_tokens - 1) // self.align * self.align
        if max_len <= end:
            self._reads.settle(rid)
            return answer
        keys = self._start_keys(request, end)
        if self._reads.wait_on_other(rid, keys):
            return TierLookup(0, wait_for_load=True)
        if self._reads.full:
            self.metrics.num_fetch_skipped += 1
            self._reads.settle(rid)
            return answer
        job = self._job(request, num_hit_tokens, end, max_len)
        if job is None:
            self._reads.settle(rid)
            return answer
        self._reads.start(job, keys, run_fetch, self.specs, self.align, self.lowers)
        self.metrics.num_fetches += 1
        return TierLookup(0, wait_for_load=True)

    def _start_keys(self, request: Request, end: int) -> list[Key]:
        views = self.host.coordinator.group_hashes(request.block_hashes)
        keys = []
        for g, spec in enumerate(self.specs):
            p = end // spec.block_size
            if p < len(views[g]):
                keys.append((g, views[g][p]))
        return keys

    def _job(self, request: Request, device_hit: int, end: int, max_len: int) -> FetchJob | None:
        """The lookup below the host for `request` beyond `end`, or None when no lower tier can
        add anything (only the disk, and it lacks the next block)."""
        views = self.host.coordinator.group_hashes(request.block_hashes)
        room = max(0, self.host.host.num_free // max(1, len(self.specs)))
        max_len = min(max_len, end + room * self.align)
        if max_len <= end:
            return None
        held: set[tuple[int, int]] = set()
        copies: list[Sequence[BlockHash]] = []
        for g, spec in enumerate(self.specs):
            bs = spec.block_size
            last = max_len // bs
            copies.append(list(views[g][:last]))
            for p in range(end // bs, last):
                if self.host.holds((g, views[g][p])):
                    held.add((g, p))
        toks = tuple(request.all_token_ids[:max_len]) if self.emits_events else ()
        job = FetchJob(
            request.request_id,
            device_hit,
            end,
            max_len,
            copies,
            frozenset(held),
            self.layouts,
            toks,
        )
        if all(t.cheap_contains for t in self.lowers):  # disk only: ask its index right here
            g = self._ref_group
            p = end // self.specs[g].block_size
            if (g, p) not in held:
                key = job.want(g, p).key
                if not any(t.store.contains([key])[0] for t in self.lowers):
                    return None
        return job

    def record_lookup(self, request: Request) -> None:
        """Count the admission's lookup in the host's and the lower tiers' metrics: per tier its
        request's own read asked, a query of the tokens beyond the tiers above; per tier, the
        tokens of the blocks it promoted that this admission loads from the host first (its
        last lookup's external tokens; whichever request's read staged them)."""
        self.host.record_lookup(request)
        last = self._reads.last_lookup(request.request_id)
        if last is None:
            return
        res = self._reads.take_result(request.request_id)
        if res is not None:
            prev = res.start
            for i, tier in enumerate(self.lowers):
                if not res.asked[i]:
                    continue
                m = self.tier_metrics[tier.name]
                m.num_queries += 1
                m.num_query_tokens += max(0, res.max_len - prev)
                prev = max(prev, res.reach[i])
        g = self._ref_group
        bs = self.specs[g].block_size
        start, end = last
        view = self.host.coordinator.group_hashes(request.block_hashes)[g]
        for p in range(start // bs, min(end // bs, len(view))):
            origin = self.host.take_origin((g, view[p]))
            if origin is None:
                continue
            m = self.tier_metrics[self.lowers[origin].name]
            if request.num_preemptions:
                m.num_preempted_hit_tokens += bs
            else:
                m.num_hit_tokens += bs

    # ---- staging -------------------------------------------------------------------------------

    def _stage_done(self) -> None:
        """Write the blocks of every landed read into host blocks and publish them there."""
        for job, result in self._reads.take_landed():
            if result is None:
                self.metrics.num_fetch_errors += 1
                continue
            self.metrics.fetch_seconds += result.seconds
            self.metrics.num_fetch_errors += bool(result.errors)
            self._stage(job, result)

    def _stage(self, job: FetchJob, result: FetchResult) -> None:
        todo = [
            (w, p, t)
            for w, p, t in result.found
            if not self.host.holds((w.group, w.key.block_hash))
        ]
        good = []
        for w, payload, t in todo:
            if len(payload) != self.io.block_bytes:
                self.metrics.num_bad_payloads += 1
                continue
            good.append((w, payload, t))
        # head of the chain first: a shortage of host blocks keeps the earlier positions
        good.sort(
            key=lambda x: ((x[0].position + 1) * self.specs[x[0].group].block_size, x[0].group)
        )
        blocks = self.host.allocate_staging(len(good))
        good = good[: len(blocks)]
        if not good:
            return
        self.io.write([b.block_id for b in blocks], [p for _, p, _ in good])
        for g in range(len(self.specs)):
            idx = [i for i, (w, _, _) in enumerate(good) if w.group == g]
            if not idx:
                continue
            chained = isinstance(self.specs[g], FullAttention)
            self.host.publish_staged(
                g,
                [blocks[i] for i in idx],
                [good[i][0].key.block_hash for i in idx],
                [good[i][0].parent if chained else None for i in idx],
                [good[i][2] for i in idx],
                [job.tokens(g, good[i][0].position, self.specs[g].block_size) for i in idx],
            )
        self.metrics.num_staged_blocks += len(good)
        for _, payload, t in good:
            m = self.tier_metrics[self.lowers[t].name]
            m.num_promoted_blocks += 1
            m.num_promoted_bytes += len(payload)
        for t in range(1, len(self.lowers)):  # promoted through the tiers above its own
            found = [(w, p) for w, p, src in good if src >= t]
            items = [(w.key, p) for w, p in found]
            named: list[_Block] = [
                (w.key, w.parent, job.tokens(w.group, w.position, self.specs[w.group].block_size))
                for w, _ in found
            ]
            for upper in self.lowers[:t]:
                self._put(upper, items, named)

    # ---- stores --------------------------------------------------------------------------------

    def _demote(self, published: list[Published]) -> None:
        if not published or not self.lowers:
            return
        published.sort(key=lambda p: (p.position, p.group_id))  # chain order: heads first
        payloads = self.io.read([p.host_block_id for p in published])
        items: list[tuple[StoreKey, bytes]] = []
        blocks: list[_Block] = []
        for p, payload in zip(published, payloads, strict=True):
            tag = p.chain[(p.position // SEGMENT_BLOCKS) * SEGMENT_BLOCKS]
            key = self.layouts[p.group_id].key(p.group_id, p.block_hash, tag)
            items.append((key, payload))
            chained = isinstance(self.specs[p.group_id], FullAttention) and p.position > 0
            blocks.append((key, p.chain[p.position - 1] if chained else None, p.token_ids))
        for tier in self.lowers:
            self._put(tier, items, blocks)

    def _put(
        self, tier: LowerTier, items: list[tuple[StoreKey, bytes]], blocks: list[_Block]
    ) -> None:
        if not items:
            return
        if self.emits_events:  # before the put: its drops and later evictions come after
            self._announce(tier.name, blocks)
        queued = tier.store.put(items)
        m = self.tier_metrics[tier.name]
        m.num_demoted_blocks += queued
        m.num_demoted_bytes += sum(len(p) for _, p in items[:queued])
        m.num_dropped_blocks += len(items) - queued

    # ---- events --------------------------------------------------------------------------------

    def _announce(self, medium: str, blocks: list[_Block]) -> None:
        events: list[KVEvent] = [
            BlockStored(
                [key.block_hash],
                parent,
                list(toks),
                key.layout.block_size,
                key.group,
                medium,
            )
            for key, parent, toks in blocks
            if toks is not None
        ]
        with self._events_lock:
            self._events.extend(events)

    def _removed(self, medium: str, keys: list[StoreKey]) -> None:
        """A store's report (any thread) of keys it does not hold."""
        events: list[KVEvent] = [BlockRemoved([k.block_hash], k.group, medium) for k in keys]
        with self._events_lock:
            self._events.extend(events)

    def take_events(self) -> list[KVEvent]:
        """The host tier's KV events since the last call, then the lower tiers' (mutates)."""
        host = self.host.take_events()
        with self._events_lock:
            lower, self._events = self._events, []
        return host + lower

    # ---- the rest of KVTier: the host tier's, plus demotion on store completion ------------------

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None:
        """The host tier's load of the last lookup's hit (staged blocks included)."""
        return self.host.plan_load(request, num_external_tokens)

    def finish_request(self, request: Request) -> list[Transfer]:
        """Forget the request's lookup (a job in flight still stages its blocks for others)."""
        self._reads.forget(request.request_id)  # a read in flight still lands and is staged
        return self.host.finish_request(request)

    def preempt_request(self, request: Request) -> list[Transfer]:
        return self.host.preempt_request(request)

    def store_before_prune(self, request: Request) -> list[Transfer]:
        return self.host.store_before_prune(request)

    def plan_stores(self, requests: Iterable[Request]) -> list[Transfer]:
        """Stage what lower tiers returned meanwhile, then the host tier's stores."""
        self._stage_done()
        return self.host.plan_stores(requests)

    def complete(self, transfer_ids: Iterable[int]) -> list[ReqId]:
        """The host tier's completions; blocks its stores published are queued below it."""
        loaded = self.host.complete(transfer_ids)
        self._demote(self.host.take_published())
        return loaded

    def fail(self, transfer_id: int) -> LoadFailure | None:
        return self.host.fail(transfer_id)

    def device_pins(self) -> dict[BlockId, int]:
        return self.host.device_pins()

    @property
    def has_pending_transfers(self) -> bool:
        return self.host.has_pending_transfers

    # ---- waiting for the I/O ----------------------------------------------------------------------

    def waiting_on_io(self) -> set[ReqId]:
        """Requests whose lookup waits for a read below the host (reads only)."""
        return self._reads.waiting()

    def wait_for_io(self, max_wait_s: float) -> bool:
        """Block up to `max_wait_s` until a read some request waits on lands or its deadline
        passes (for an engine with nothing else to do: cheaper than stepping empty forwards).
        True when one has (the next lookup makes progress), False when all still wait; reads
        nobody waits on end no wait (`InFlightReads.wait`). Mutates nothing."""
        return self._reads.wait(max_wait_s)

    # ---- lifecycle and stats ---------------------------------------------------------------------

    def tier_stats(self) -> list[TierStats]:
        """Snapshots of every lower tier's counters and its store's (changes nothing)."""
        return [
            TierStats(t.name, replace(self.tier_metrics[t.name]), t.store.stats())
            for t in self.lowers
        ]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write is written; False past `timeout` seconds."""
        return all(t.store.flush(timeout) for t in self.lowers)

    def close(self) -> None:
        """Stop the fetch threads, finish queued writes and close the stores (idempotent)."""
        self._reads.close()
        for t in self.lowers:
            t.store.close()
