"""One manager per attention type: a request's block table for one KV-cache group.

Tables are append-only lists indexed by block position; skipped positions hold the null block.
Managers never pick requests or step seqs; they apply what the coordinator asks, through the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtier.ids import BlockHash, ReqId
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import BlockPool
from kvtier.kv.specs import ChunkedLocal, FullAttention, KVSpec, Mamba, SlidingWindow, cdiv


class SingleTypeManager(ABC):
    """Shared behaviour; subclasses differ in cache-hit search and (Mamba) which blocks are real."""

    def __init__(self, spec: KVSpec, pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.null_block = pool.null_block
        self.req_to_blocks: dict[ReqId, list[KVBlock]] = {}
        self.num_cached_block: dict[ReqId, int] = {}
        self._num_pruned: dict[ReqId, int] = {}  # INVARIANT: positions below are all null
        self._num_real: dict[ReqId, int] = {}
        # Σ over requests of blocks held beyond the steady charge (the transient reserve in use).
        self.num_excess_blocks = 0
        self._steady_cap = spec.steady_blocks(1 << 62)

    # ---- counting ------------------------------------------------------------------------------

    def _set_real(self, req_id: ReqId, num_real: int) -> None:
        old = self._num_real.get(req_id, 0)
        self._num_real[req_id] = num_real
        cap = self._steady_cap
        self.num_excess_blocks += max(0, num_real - cap) - max(0, old - cap)

    def num_real_blocks(self, req_id: ReqId) -> int:
        return self._num_real.get(req_id, 0)

    def _num_real_of_new(self, num_new_positions: int) -> int:
        return num_new_positions

    def num_blocks_to_allocate(
        self,
        req_id: ReqId,
        num_tokens: int,
        new_computed_blocks: Sequence[KVBlock],
        total_computed_tokens: int,
    ) -> int:
        """Free blocks an allocation up to `num_tokens` would consume (hits with ref 0 included)."""
        required = cdiv(num_tokens, self.block_size)
        table = self.req_to_blocks.get(req_id)
        if table is not None:  # running: only growth (hits are never added to a running request)
            return self._num_real_of_new(max(required - len(table), 0))
        skipped = self.spec.num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped, len(new_computed_blocks)), 0)
        evictable = sum(
            1 for b in new_computed_blocks[skipped:] if b.ref_cnt == 0 and not b.is_null
        )
        return self._num_real_of_new(num_new) + evictable

    # ---- mutation ------------------------------------------------------------------------------

    def add_computed_blocks(
        self, req_id: ReqId, new_computed_blocks: Sequence[KVBlock], total_computed_tokens: int
    ) -> None:
        """Start a new request's table from its prefix hits (touching those inside the window)."""
        assert req_id not in self.req_to_blocks, f"{req_id} already has a table"
        skipped = min(
            self.spec.num_skipped_tokens(total_computed_tokens) // self.block_size,
            len(new_computed_blocks),
        )
        kept = list(new_computed_blocks[skipped:])
        self.pool.touch(kept)
        self.req_to_blocks[req_id] = [self.null_block] * skipped + kept
        self.num_cached_block[req_id] = len(new_computed_blocks)
        self._num_pruned[req_id] = 0
        self._set_real(req_id, sum(1 for b in kept if not b.is_null))

    def allocate_new_blocks(
        self, req_id: ReqId, num_tokens: int, total_computed_tokens: int
    ) -> list[KVBlock]:
        """Extend the table to cover `num_tokens`; positions already skipped get the null block.

        Callers check capacity first (`num_blocks_to_allocate`); returns the positions appended
        to the table, in order: new real blocks, and the null block where a position is skipped.
        """
        table = self.req_to_blocks.get(req_id)
        if table is None:
            table = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
            self._num_pruned[req_id] = 0
        required = cdiv(num_tokens, self.block_size)
        start = len(table)
        if required <= start:
            return []
        skipped = self.spec.num_skipped_tokens(total_computed_tokens) // self.block_size
        num_null = max(0, min(skipped, required) - start)
        table.extend([self.null_block] * num_null)
        new_blocks = self._extend_real(table, required - len(table))
        self._set_real(req_id, self.num_real_blocks(req_id) + len(new_blocks))
        return table[start:]

    def _extend_real(self, table: list[KVBlock], num_positions: int) -> list[KVBlock]:
        new_blocks = self.pool.get_new_blocks(num_positions)
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self,
        req_id: ReqId,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register the request's full blocks up to `num_tokens` in the prefix cache."""
        num_cached = self.num_cached_block[req_id]
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full <= num_cached:
            return
        table = self.req_to_blocks[req_id]
        self.pool.cache_full_blocks(
            self.group_id, table, block_hashes, num_cached, num_full, self.block_size, token_ids
        )
        self.num_cached_block[req_id] = num_full

    def mark_snapshot(self, req_id: ReqId, num_tokens: int) -> None:  # noqa: B027
        """The device holds exactly `num_tokens` of the request's tokens (a processed step's
        end): nothing to record except for state groups."""

    def remove_skipped_blocks(
        self, req_id: ReqId, num_settled_tokens: int, last_step_seq: int | None
    ) -> int:
        """Null and free blocks no query at or after `num_settled_tokens` can read.

        Frees go through the pool's quarantine stamped `last_step_seq`; higher positions (longer
        chains) are freed first. Returns the number of blocks released from the table.
        """
        table = self.req_to_blocks.get(req_id)
        if not table:
            return 0
        end = min(self.spec.num_skipped_tokens(num_settled_tokens) // self.block_size, len(table))
        start = self._num_pruned[req_id]
        if end <= start:
            return 0
        removed: list[KVBlock] = []
        null = self.null_block
        for i in range(end - 1, start - 1, -1):
            block = table[i]
            if not block.is_null:
                removed.append(block)
                table[i] = null
        self._num_pruned[req_id] = end
        if removed:
            self.pool.free(removed, last_step_seq)
            self._set_real(req_id, self.num_real_blocks(req_id) - len(removed))
        return len(removed)

    def free(self, req_id: ReqId, last_step_seq: int | None) -> None:
        """Drop the request's table; its blocks are freed tail first (through the quarantine)."""
        table = self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        self._num_pruned.pop(req_id, None)
        if table is None:
            return
        self._set_real(req_id, 0)
        del self._num_real[req_id]
        self.pool.free(reversed(table), last_step_seq)

    # ---- prefix-cache lookup -------------------------------------------------------------------

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
    ) -> list[KVBlock]:
        """Blocks of the longest cached prefix of at most `max_length` tokens, a multiple of
        `alignment` tokens; skipped positions are null. Touches nothing."""


class FullAttentionManager(SingleTypeManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
    ) -> list[KVBlock]:
        hits: list[KVBlock] = []
        get = self.pool.get_cached_block
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = get(self.group_id, block_hash)
            if block is None:
                break  # chained hashes: a miss implies every later block misses
            hits.append(block)
        aligned = len(hits) * self.block_size // alignment * alignment
        del hits[aligned // self.block_size :]
        return hits


class SlidingWindowManager(SingleTypeManager):
    def _num_contiguous_needed(self) -> int:
        assert isinstance(self.spec, SlidingWindow)
        return cdiv(self.spec.window - 1, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
    ) -> list[KVBlock]:
        # A hit ending at block L needs blocks [L - needed, L) cached. Scan right to left over runs
        # of cached blocks; a run ending at `run_end` can only serve its largest aligned end.
        bs, needed = self.block_size, self._num_contiguous_needed()
        step = alignment // bs
        num_blocks = min(max_length // bs, len(block_hashes))
        if needed == 0:  # a one-token window reads only keys the step computes itself
            return [self.null_block] * (num_blocks // step * step)
        get = self.pool.get_cached_block
        run: list[KVBlock] = []  # the current run, right to left
        run_end = num_blocks
        for i in range(num_blocks - 1, -1, -1):
            block = get(self.group_id, block_hashes[i])
            if block is None:
                run, run_end = [], i
                continue
            run.append(block)
            end = run_end // step * step
            if end > i and (end - needed >= i or i == 0):
                start = max(0, end - needed)
                return [self.null_block] * start + [run[run_end - 1 - j] for j in range(start, end)]
        return []


class ChunkedLocalManager(SingleTypeManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
    ) -> list[KVBlock]:
        assert isinstance(self.spec, ChunkedLocal)
        bs = self.block_size
        max_length = min(max_length, len(block_hashes) * bs)  # only full blocks can hit
        local_start = max_length // self.spec.chunk * self.spec.chunk // bs
        hits = [self.null_block] * local_start  # earlier chunks are invisible: nothing to look up
        get = self.pool.get_cached_block
        for i in range(local_start, max_length // bs):
            block = get(self.group_id, block_hashes[i])
            if block is None:
                break
            hits.append(block)
        aligned = len(hits) * bs // alignment * alignment
        del hits[aligned // bs :]
        return hits


class MambaManager(SingleTypeManager):
    """Only the state block of the last computed token is real; a block is a reusable snapshot
    only if the device's count after some processed step ended exactly at its end (otherwise it
    holds an earlier or later state). Snapshots are marked on verified ends (`mark_snapshot`,
    reported by the scheduler once a step is processed, drafts rolled back), never on scheduled
    ones (architecture.md §Rollback)."""

    def __init__(self, spec: KVSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        # INVARIANT: positions marked as snapshots and not yet published (their hashes unknown).
        self._snapshots: dict[ReqId, set[int]] = {}

    def _num_real_of_new(self, num_new_positions: int) -> int:
        return min(1, num_new_positions)

    def _extend_real(self, table: list[KVBlock], num_positions: int) -> list[KVBlock]:
        if num_positions <= 0:
            return []
        table.extend([self.null_block] * (num_positions - 1))
        return super()._extend_real(table, 1)

    def add_computed_blocks(
        self, req_id: ReqId, new_computed_blocks: Sequence[KVBlock], total_computed_tokens: int
    ) -> None:
        super().add_computed_blocks(req_id, new_computed_blocks, total_computed_tokens)
        self._snapshots[req_id] = set()

    def mark_snapshot(self, req_id: ReqId, num_tokens: int) -> None:
        """The block ending at `num_tokens`, if any, holds the state after exactly that many
        tokens: publish it with the next `cache_blocks` that knows its hash (mutates)."""
        if num_tokens <= 0 or num_tokens % self.block_size:
            return
        pos = num_tokens // self.block_size - 1
        table = self.req_to_blocks.get(req_id)
        if table is None or pos >= len(table) or table[pos].is_null:
            return
        if table[pos].block_hash is None:
            self._snapshots.setdefault(req_id, set()).add(pos)

    def cache_blocks(
        self,
        req_id: ReqId,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Publish the marked snapshots among the request's first `num_tokens` tokens."""
        pending = self._snapshots.get(req_id)
        if not pending:
            return
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        table = self.req_to_blocks[req_id]
        for pos in sorted(p for p in pending if p < num_full):
            pending.discard(pos)
            self.pool.cache_full_blocks(
                self.group_id, table, block_hashes, pos, pos + 1, self.block_size, token_ids
            )

    def free(self, req_id: ReqId, last_step_seq: int | None) -> None:
        self._snapshots.pop(req_id, None)
        super().free(req_id, last_step_seq)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, alignment: int
    ) -> list[KVBlock]:
        bs, step = self.block_size, alignment // self.block_size
        get = self.pool.get_cached_block
        for i in range(min(max_length // bs, len(block_hashes)) - 1, -1, -1):
            if (i + 1) % step:
                continue
            block = get(self.group_id, block_hashes[i])
            if block is not None:
                return [self.null_block] * i + [block]
        return []


MANAGER_TYPES: dict[type, type[SingleTypeManager]] = {
    FullAttention: FullAttentionManager,
    SlidingWindow: SlidingWindowManager,
    ChunkedLocal: ChunkedLocalManager,
    Mamba: MambaManager,
}


def make_manager(spec: KVSpec, pool: BlockPool, group_id: int) -> SingleTypeManager:
    return MANAGER_TYPES[type(spec)](spec, pool, group_id)
