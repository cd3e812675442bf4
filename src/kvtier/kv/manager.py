"""KVCacheManager: the scheduler's one door to the KV cache of a tier (lookup, allocate, prune, free).

Request semantics on top of the coordinator: hit accounting, caching bounds, and admission through
`AdmissionCharges` (`charge.py`). Never decides which request runs; never reads a clock or a device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.ids import BlockHash, BlockId
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import BlockPool, IntegrityError
from kvtier.kv.charge import AdmissionCharges, Charge
from kvtier.kv.coordinator import GroupBlocks, KVCacheCoordinator
from kvtier.kv.events import KVEvent
from kvtier.kv.hashing import BlockHasher, HashExtras
from kvtier.kv.request import KVSequence
from kvtier.kv.specs import (
    SHARED,
    AdmissionPolicy,
    KVSpec,
    blocks_for_requests,
    max_concurrency,
)
from kvtier.kv.stats import PoolStats


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters with their denominators (tokens), one count per admission (as
    vLLM): a request that waits or retries is looked up again but counted once. Re-admissions
    after preemption are counted apart, so the hit rate is that of first admissions."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_preempted_requests: int = 0
    num_preempted_query_tokens: int = 0
    num_preempted_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int, preempted: bool) -> None:
        """Count one admission of a request of `num_tokens` with `num_hit_tokens` hit."""
        if preempted:
            self.num_preempted_requests += 1
            self.num_preempted_query_tokens += num_tokens
            self.num_preempted_hit_tokens += num_hit_tokens
        else:
            self.num_requests += 1
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens


class KVCacheManager:
    """Facade over one pool and its coordinator.

    `max_in_flight_tokens` bounds tokens scheduled but not yet settled across all requests
    (async depth × token budget); it sizes the transient need of window groups while steps are in
    flight. `admission` says how that need is charged: per request (beyond its steady window, at
    its length when admitted) and once per pool (default: one shared reserve, nothing per request).
    A new request is admitted when its blocks and the part of that reserve not held by tables fit
    in the free blocks (`charges`, an `AdmissionCharges`, keeps what each request was charged). With `admit_whole_prompt` (vLLM's `scheduler_reserve_full_isl`) they must
    also hold the steady windows of its whole prompt, not only of this chunk, beside what admitted
    requests were promised and have not allocated yet: admission is then the sizing formula
    (`blocks_for_requests`, `max_concurrency`) over the prompts of the requests admitted.
    """

    def __init__(
        self,
        specs: Sequence[KVSpec],
        num_blocks: int,
        *,
        max_model_len: int,
        enable_caching: bool = True,
        enable_quarantine: bool = True,
        max_in_flight_tokens: int = 0,
        hash_fn: str = "sha256",
        enable_kv_events: bool = False,
        medium: str = "device",
        admission: AdmissionPolicy = SHARED,
        admit_whole_prompt: bool = False,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if max_in_flight_tokens < 0:
            raise ValueError(f"max_in_flight_tokens must be ≥ 0, got {max_in_flight_tokens}")
        self.pool = BlockPool(
            num_blocks, enable_caching, enable_quarantine, enable_kv_events, medium=medium
        )
        self.coordinator = KVCacheCoordinator(specs, self.pool)
        self.specs = self.coordinator.specs
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.max_in_flight_tokens = max_in_flight_tokens
        self.admission = admission
        self.charges = AdmissionCharges(
            self.coordinator,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            admission=admission,
            admit_whole_prompt=admit_whole_prompt,
        )
        self.hasher = BlockHasher(self.coordinator.hash_block_size, hash_fn)
        self.stats = PrefixCacheStats()
        self._no_hits: GroupBlocks = [[] for _ in self.specs]

    def new_sequence(
        self, request_id: str, prompt_token_ids: Sequence[int], extras: HashExtras | None = None
    ) -> KVSequence:
        """A `KVSequence` hashed with this manager's hasher (what the scheduler's requests hold)."""
        return KVSequence(request_id, prompt_token_ids, self.hasher, extras)

    # ---- lookup --------------------------------------------------------------------------------

    def get_computed_blocks(self, request: KVSequence) -> tuple[GroupBlocks, int]:
        """Longest prefix hit for a waiting request: (blocks per group, hit tokens). Touches
        nothing and counts nothing (`record_lookup` counts the lookup an admission used).

        The last prompt token is always recomputed (its logits are needed), so at most
        num_tokens − 1 tokens hit.
        """
        if not self.enable_caching:
            return self._no_hits, 0
        max_length = min(request.num_tokens - 1, self.max_model_len)
        return self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)

    def record_lookup(self, request: KVSequence, num_hit_tokens: int, preempted: bool) -> None:
        """Count the lookup a request was admitted with (once per admission) in `stats`."""
        if self.enable_caching:
            self.stats.record(request.num_tokens, num_hit_tokens, preempted)

    # ---- allocation ----------------------------------------------------------------------------

    def reserve_shortfall(self, num_new_requests: int = 0) -> int:
        """Blocks of the transient reserve not currently held (≥ 0) with `num_new_requests`
        more requests (`AdmissionCharges.reserve_shortfall`). Changes nothing."""
        return self.charges.reserve_shortfall(num_new_requests)

    def allocate_slots(
        self,
        request: KVSequence,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """Make room for `num_new_tokens` (+ lookahead) after the request's computed tokens.

        For a new request also installs its prefix hits and room for externally loaded tokens.
        Returns, per group, the positions appended to the request's table (new blocks, and the
        null block where a position is skipped), or None — changing nothing — when the free
        blocks (less the transient reserve, for a new request) do not suffice.
        Out-of-window pruning is separate: `remove_skipped_blocks` on the settled count.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError("token counts passed to allocate_slots must be ≥ 0")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("allocate_slots needs new tokens or externally computed tokens")
        req_id = request.request_id
        hits = new_computed_blocks if new_computed_blocks is not None else self._no_hits
        is_new = not self.coordinator.has_request(req_id)
        assert is_new or not any(hits), "prefix hits are only added to a new request"
        total_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        num_tokens = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        need, charge = self._num_needed(request, num_tokens, hits, total_computed)
        if need > self.pool.num_free_blocks:
            return None
        if charge is not None:
            self.charges.add(req_id, charge)
            self.coordinator.add_computed_blocks(req_id, hits, total_computed)
        new_blocks = self.coordinator.allocate_new_blocks(req_id, num_tokens, total_computed)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _num_needed(
        self, request: KVSequence, num_tokens: int, hits: GroupBlocks, total_computed: int
    ) -> tuple[int, Charge | None]:
        """(free blocks `allocate_slots` needs, the admission charge of a new request or None)."""
        req_id = request.request_id
        need = self.coordinator.num_blocks_to_allocate(req_id, num_tokens, hits, total_computed)
        if self.coordinator.has_request(req_id):
            return need, None
        return self.charges.charge_new(request.num_tokens, num_tokens, hits, total_computed, need)

    def num_blocks_short(self, request: KVSequence, num_new_tokens: int) -> int:
        """Blocks beyond the free ones that `allocate_slots(request, num_new_tokens)` of a
        request already holding blocks needs (0: it fits now). Changes nothing."""
        num_tokens = min(request.num_computed_tokens + num_new_tokens, self.max_model_len)
        need, _ = self._num_needed(request, num_tokens, self._no_hits, request.num_computed_tokens)
        return max(0, need - self.pool.num_free_blocks)

    def num_blocks_returning(self, finishing: Iterable[str] = ()) -> int:
        """Blocks that come back to the free queue once every step in flight is processed (at
        most `async_depth − 1` steps away when a step is being scheduled): the quarantine's, and
        the tables of the `finishing` requests, which those steps end."""
        tables = [b for rid in finishing for table in self.get_blocks(rid) for b in table]
        return self.pool.num_quarantined_freeable(also_released=tables)

    def cache_blocks(self, request: KVSequence, num_tokens: int) -> None:
        """Publish the request's full blocks up to `num_tokens` as prefix-cache entries."""
        if self.enable_caching:
            self.coordinator.cache_blocks(
                request.request_id, request.block_hashes, num_tokens, request.all_token_ids
            )

    def cache_verified(self, request: KVSequence, num_tokens: int) -> None:
        """The device holds exactly `num_tokens` of the request's tokens: a processed step's
        end (rejected drafts excluded) or a landed load. A state group whose block ends there
        marks it as a snapshot; every group publishes its full blocks up to there (mutates;
        nothing with caching off). Snapshots are never marked on scheduled ends, which a
        rejected draft may never reach (architecture.md §Rollback)."""
        if self.enable_caching:
            self.coordinator.mark_snapshots(request.request_id, num_tokens)
            self.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(
        self, request_id: str, num_settled_tokens: int, last_step_seq: int | None = None
    ) -> int:
        """Null and free out-of-window blocks below `num_settled_tokens` (through the quarantine,
        stamped `last_step_seq`). Returns the number of blocks taken out of the tables."""
        return self.coordinator.remove_skipped_blocks(request_id, num_settled_tokens, last_step_seq)

    def free(self, request_id: str, last_step_seq: int | None = None) -> None:
        """Release every block of the request (tail first), quarantined until `last_step_seq`,
        and its admission charge."""
        self.coordinator.free(request_id, last_step_seq)
        self.charges.release(request_id)

    def release_quarantine(self, processed_step_seq: int) -> int:
        """Steps up to `processed_step_seq` are processed; returns references released."""
        return self.pool.release_quarantine(processed_step_seq)

    # ---- pins: references held by copies between tiers ------------------------------------------

    def pin(self, blocks: Iterable[KVBlock]) -> None:
        """Take one reference on each block for a holder outside the tables (a copy in flight;
        mutates). A pinned block is never reallocated; `unpin` drops the reference."""
        self.pool.touch(blocks)

    def unpin(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the references `pin` took (at once: the copy that held them has ended)."""
        self.pool.free(blocks)

    def evict_blocks(self, block_ids: Iterable[BlockId]) -> None:
        """Drop these blocks from the prefix cache (their content is bad, e.g. a failed load);
        holders keep them, but no lookup finds them again (mutates)."""
        self.pool.evict_blocks(block_ids)

    # ---- views ---------------------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """True while the request holds a block table here."""
        return self.coordinator.has_request(request_id)

    def get_cached_block(self, group_id: int, block_hash: BlockHash) -> KVBlock | None:
        """The block caching `block_hash` in group `group_id`, if any (touches nothing)."""
        return self.pool.get_cached_block(group_id, block_hash)

    def eviction_order(self) -> Iterator[KVBlock]:
        """Free blocks, the next to be reused first (read-only; do not allocate meanwhile)."""
        return iter(self.pool.free_queue)

    def pool_stats(self) -> PoolStats:
        """A snapshot of the pool (`BlockPool.stats`). Changes nothing."""
        return self.pool.stats()

    @property
    def num_blocks(self) -> int:
        """Blocks of the pool, the null block included."""
        return self.pool.num_blocks

    @property
    def enable_quarantine(self) -> bool:
        return self.pool.enable_quarantine

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[BlockId], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.get_blocks(request_id))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def max_concurrency(self, num_tokens: int | None = None) -> int:
        """Requests of `num_tokens` (default max_model_len) that fit; same formula as admission."""
        n = self.max_model_len if num_tokens is None else num_tokens
        usable, f = self.pool.num_blocks - 1, self.max_in_flight_tokens
        return max_concurrency(self.specs, usable, n, f, self.admission, self.max_model_len)

    def blocks_for_requests(self, num_requests: int, num_tokens: int) -> int:
        """What `num_requests` requests of `num_tokens` need under this manager's admission."""
        f, cap = self.max_in_flight_tokens, self.max_model_len
        return blocks_for_requests(self.specs, num_requests, num_tokens, f, self.admission, cap)

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self, num_pinned: dict[BlockId, int] | None = None) -> None:
        """Check pool invariants and that every reference has a holder (architecture.md §I1, §I5):
        tables, quarantine, and `num_pinned` references held by others (e.g. transfers); and that
        every admitted request carries its admission charge. Raises `IntegrityError` naming the
        first broken one."""
        self.pool.check_integrity()
        self.charges.check_integrity()
        holders: dict[BlockId, int] = dict(num_pinned or {})
        for mgr in self.coordinator.managers:
            for req_id, table in mgr.req_to_blocks.items():
                real = 0
                for block in table:
                    if not block.is_null:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
                        real += 1
                if real != (counted := mgr.num_real_blocks(req_id)):
                    raise IntegrityError(
                        f"{req_id}: real-block count drifted: {counted} counted, {real} in its table"
                    )
        for block_id in self.pool.quarantined_block_ids():
            holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise IntegrityError(f"{block!r}: {expected} holders")


__all__ = ["KVBlock", "KVCacheManager", "PrefixCacheStats"]
