"""BlockPool: one tier's physical blocks, ref counts, the prefix-cache map, the quarantine, events.

Torch-free bookkeeping over integer block ids; never decides *which* request needs blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvtier.ids import BlockHash, BlockId
from kvtier.kv.block import FreeBlockQueue, KVBlock
from kvtier.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.kv.stats import PoolStats

_CachedEntry = KVBlock | dict[BlockId, KVBlock]


class IntegrityError(RuntimeError):
    """kvtier's bookkeeping is broken (a bug, never bad input): found by a `check_integrity`, or
    refused at a call that would break it (a block freed more often than referenced or cached
    under another hash, which would hand one block to two owners; a request's ledger consuming
    steps out of order). Raised explicitly rather than asserted so that `python -O` still checks."""


class BlockPool:
    """Pre-allocated blocks with ref counts, a null block, an LRU free queue and a hash map.

    Free policy (architecture.md §History): blocks reaching ref count 0 go to the free queue in the
    order given; unhashed ("fresh") ones are prepended (reused first), hashed ones appended (kept
    longest as prefix-cache candidates). With caching off every freed block is prepended (LIFO).
    LIFO reuse maximises locality and would amplify any premature free; the quarantine makes it safe.

    Quarantine (architecture.md §Quarantine): `free(blocks, last_step_seq)` with a stamp the device
    may still work on keeps the blocks' references until `release_quarantine(k)` reaches the stamp.
    A quarantined block is neither allocatable nor counted free. It stays findable as a prefix hit
    when it carries a hash: hashes are set only on full blocks whose tokens are final, so every
    pending access to such a block is a compute-stream read or the write that produced it, and a new
    holder only adds compute-stream reads in later steps (FIFO-ordered after them). Taking a hit just
    adds a reference, so the block cannot be recycled until both the stamp and the new holder release.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_quarantine: bool = True,
        enable_kv_events: bool = False,
        medium: str = "device",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_quarantine = enable_quarantine
        self.enable_kv_events = enable_kv_events
        self.medium = medium
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Block 0 is the null block: a placeholder for skipped positions; never freed or cached.
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        # group id -> block hash -> one block, or {block id: block} when several share the hash.
        self._cached: dict[int, dict[BlockHash, _CachedEntry]] = {}
        self._num_cached = 0  # blocks in `_cached`, kept as it changes: a stats read walks nothing
        # (stamp, insertion seq, blocks); INVARIANT: every stamp > processed_step_seq.
        self._quarantine: list[tuple[int, int, list[KVBlock]]] = []
        self._quarantine_seq = 0
        self.num_quarantined_refs = 0
        self.processed_step_seq = 0
        self._events: list[KVEvent] = []

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (cached-but-unreferenced blocks included; quarantined excluded)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable (non-null) blocks that are not free."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # ---- prefix-cache map ----------------------------------------------------------------------

    def get_cached_block(self, group_id: int, block_hash: BlockHash) -> KVBlock | None:
        """One block of `group_id` registered under `block_hash`, or None."""
        entry = self._cached.get(group_id, {}).get(block_hash)
        if entry is None or isinstance(entry, KVBlock):
            return entry
        return next(iter(entry.values()))

    def cache_full_blocks(
        self,
        group_id: int,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register blocks [num_cached_blocks, num_full_blocks) under their hashes (mutates map).

        Null blocks are skipped; a block that already carries a hash (a prefix hit) must carry the
        expected one. Duplicates of identical content are kept side by side, never merged.
        `token_ids`: the sequence's tokens from its first block on (for the events).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        # runs of consecutive hashes cached here for the first time: one BlockStored each
        runs: list[list[int]] = [[]]
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                runs.append([])
            elif block.block_hash is not None:
                if block.block_hash != block_hashes[i] or block.group_id != group_id:
                    raise IntegrityError(
                        f"{block!r} is cached as {block.block_hash!r} in group {block.group_id}, "
                        f"asked to cache it as {block_hashes[i]!r} in group {group_id}"
                    )
                runs.append([])
            elif self._register(
                group_id, block, block_hashes[i], self._tokens(token_ids, i, block_size)
            ):
                runs[-1].append(i)
            else:  # another copy of a hash already cached (and announced)
                runs.append([])
        if not self.enable_kv_events:
            return
        for run in runs:
            if run:
                start, end = run[0], run[-1] + 1
                self._events.append(
                    BlockStored(
                        [block_hashes[i] for i in run],
                        block_hashes[start - 1] if start > 0 else None,
                        list(token_ids[start * block_size : end * block_size]),
                        block_size,
                        group_id,
                        self.medium,
                    )
                )

    def cache_block(
        self,
        group_id: int,
        block: KVBlock,
        block_hash: BlockHash,
        parent: BlockHash | None,
        block_size: int,
        token_ids: Sequence[int] | None,
    ) -> None:
        """Register one block whose chain is known only by its parent's hash (a tier's copy).
        `token_ids`: its own tokens; without them no event announces it (a consumer matches
        blocks by their tokens)."""
        assert block.block_hash is None and not block.is_null
        toks = tuple(token_ids) if token_ids is not None and self.enable_kv_events else None
        first = self._register(group_id, block, block_hash, toks)
        if first and toks is not None and len(toks) == block_size:
            self._events.append(
                BlockStored([block_hash], parent, list(toks), block_size, group_id, self.medium)
            )

    def _tokens(self, token_ids: Sequence[int], i: int, block_size: int) -> tuple[int, ...] | None:
        if not self.enable_kv_events or len(token_ids) < (i + 1) * block_size:
            return None
        return tuple(token_ids[i * block_size : (i + 1) * block_size])

    def _register(
        self,
        group_id: int,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...] | None,
    ) -> bool:
        """Put `block` in the map under `block_hash`; True when it is the hash's first copy."""
        block.block_hash = block_hash
        block.group_id = group_id
        block.token_ids = token_ids
        table = self._cached.setdefault(group_id, {})
        entry = table.get(block_hash)
        if entry is None:
            table[block_hash] = block
        elif isinstance(entry, KVBlock):
            table[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        self._num_cached += 1
        return entry is None

    def _uncache(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        table = self._cached[block.group_id]
        entry = table[block_hash]
        last_copy = isinstance(entry, KVBlock)
        if isinstance(entry, KVBlock):
            del table[block_hash]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                table[block_hash] = next(iter(entry.values()))
        self._num_cached -= 1
        if self.enable_kv_events and last_copy:  # a consumer tracks hashes, not copies
            self._events.append(BlockRemoved([block_hash], block.group_id, self.medium))
        block.block_hash = None
        block.group_id = -1
        block.token_ids = None

    def evict_blocks(self, block_ids: Iterable[BlockId]) -> None:
        """Drop the given blocks from the prefix-cache map only (e.g. after a failed load)."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id])

    # ---- allocation and ref counts -------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` from the LRU end, evicting their cache entries; ref 1 each.

        Raises ValueError if fewer are free; callers check `num_free_blocks` first.
        """
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each non-null block, taking ref-0 blocks out of the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock], last_step_seq: int | None = None) -> None:
        """Drop one reference per block, in eviction order (the first given is evicted first).

        `last_step_seq` is the last scheduled step that may still read or write the blocks; if the
        quarantine is on and that step is unprocessed, the references are kept until it is.
        """
        live = [b for b in blocks if not b.is_null]
        if not live:
            return
        if (
            self.enable_quarantine
            and last_step_seq is not None
            and last_step_seq > self.processed_step_seq
        ):
            heapq.heappush(self._quarantine, (last_step_seq, self._quarantine_seq, live))
            self._quarantine_seq += 1
            self.num_quarantined_refs += len(live)
            return
        self._release(live)

    def _release(self, blocks: list[KVBlock]) -> None:
        fresh: list[KVBlock] = []
        cached: list[KVBlock] = []
        for block in blocks:
            if block.ref_cnt == 0:
                raise IntegrityError(f"{block!r} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_hash is not None:
                    cached.append(block)
                else:
                    fresh.append(block)
        self.free_queue.prepend_n(fresh)
        self.free_queue.append_n(cached)

    def release_quarantine(self, processed_step_seq: int) -> int:
        """Record that steps ≤ `processed_step_seq` are processed; free what they held.

        Returns the number of block references released.
        """
        if processed_step_seq > self.processed_step_seq:
            self.processed_step_seq = processed_step_seq
        released = 0
        while self._quarantine and self._quarantine[0][0] <= self.processed_step_seq:
            _, _, blocks = heapq.heappop(self._quarantine)
            self._release(blocks)
            released += len(blocks)
        self.num_quarantined_refs -= released
        return released

    def num_quarantined_freeable(
        self, up_to_step: int | None = None, also_released: Iterable[KVBlock] = ()
    ) -> int:
        """Blocks that releasing the quarantine up to step `up_to_step` (None: all of it), and one
        reference of each block in `also_released`, would return to the free queue: those whose
        every reference is among these (a block shared with a live holder returns nothing)."""
        counts: dict[BlockId, int] = {}
        for stamp, _, blocks in self._quarantine:
            if up_to_step is None or stamp <= up_to_step:
                for b in blocks:
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in also_released:
            if not b.is_null:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        return sum(1 for block_id, n in counts.items() if self.blocks[block_id].ref_cnt == n)

    def quarantined_refs_by_step(self) -> dict[int, int]:
        """Release step -> block references the quarantine holds until that step is processed."""
        out: dict[int, int] = {}
        for stamp, _, blocks in self._quarantine:
            out[stamp] = out.get(stamp, 0) + len(blocks)
        return dict(sorted(out.items()))

    def quarantined_block_ids(self) -> list[BlockId]:
        """Block ids held by the quarantine (with repeats for repeated references)."""
        return [b.block_id for _, _, blocks in self._quarantine for b in blocks]

    # ---- reset, events, integrity --------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use or quarantined."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
            block.token_ids = None
        self._cached.clear()
        self._num_cached = 0
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared(self.medium))
        return True

    def take_events(self) -> list[KVEvent]:
        """Drain and return the queued KV events."""
        events, self._events = self._events, []
        return events

    def num_cached_entries(self) -> int:
        """Blocks registered in the prefix-cache map (all groups)."""
        return self._num_cached

    def stats(self) -> PoolStats:
        """A snapshot of this pool's counts (changes nothing)."""
        num_usable = self.num_blocks - 1
        return PoolStats(
            medium=self.medium,
            num_blocks=num_usable,
            num_free=self.num_free_blocks,
            num_used=num_usable - self.num_free_blocks,
            num_cached=self.num_cached_entries(),
            num_quarantined_refs=self.num_quarantined_refs,
            quarantined_refs_by_step=tuple(self.quarantined_refs_by_step().items()),
        )

    def check_integrity(self) -> None:
        """Check the pool's invariants; raises `IntegrityError` naming the first broken one."""
        in_queue = set()
        for block in self.free_queue:
            if block.ref_cnt != 0:
                raise IntegrityError(f"{block!r} in the free queue with references")
            if block.is_null:
                raise IntegrityError("null block in the free queue")
            in_queue.add(block.block_id)
        if len(in_queue) != self.num_free_blocks:
            raise IntegrityError(
                f"free count {self.num_free_blocks} disagrees with the queue's {len(in_queue)}"
            )
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise IntegrityError(f"{block!r} has a negative ref count")
            if (block.ref_cnt == 0) != (block.block_id in in_queue):
                raise IntegrityError(f"{block!r} misfiled (free iff unreferenced)")
            if block.block_hash is not None:
                found = self._cached.get(block.group_id, {}).get(block.block_hash)
                ok = found is block or (
                    isinstance(found, dict) and found.get(block.block_id) is block
                )
                if not ok:
                    raise IntegrityError(f"{block!r} has a hash but is not in the map")
        if self.null_block.block_hash is not None or self.null_block.ref_cnt != 0:
            raise IntegrityError(f"null block {self.null_block!r} hashed or referenced")
        num_cached = 0
        for gid, table in self._cached.items():
            for block_hash, entry in table.items():
                group = [entry] if isinstance(entry, KVBlock) else list(entry.values())
                if not group:
                    raise IntegrityError(f"empty duplicate set in the map of group {gid}")
                for block in group:
                    if block.block_hash != block_hash or block.group_id != gid:
                        raise IntegrityError(f"{block!r} filed under another hash or group")
                num_cached += len(group)
        if num_cached != self._num_cached:
            raise IntegrityError(f"cached block count drifted: {self._num_cached} ≠ {num_cached}")
        refs = 0
        for stamp, _, blocks in self._quarantine:
            if stamp <= self.processed_step_seq:
                raise IntegrityError(f"quarantine entry of step {stamp} past its stamp")
            for block in blocks:
                if block.ref_cnt <= 0:
                    raise IntegrityError(f"quarantined {block!r} without a reference")
            refs += len(blocks)
        if refs != self.num_quarantined_refs:
            raise IntegrityError(
                f"quarantine ref count drifted: {self.num_quarantined_refs} ≠ {refs} held"
            )
