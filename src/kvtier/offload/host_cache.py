"""HostCache: the host tier's `BlockPool` plus chain-aware eviction.

A lookup stops at the first missing block of a chain, so evicting in store-completion order (a
request's first blocks, stored first, go first) would strand the rest of the chain (architecture.md
§H5). Two rules keep chains whole instead:

(a) a completed store frees its blocks deepest-first, so a chain's tail is evicted before its head;
(b) when an entry is evicted, its cached descendants (orphans: no lookup can reach them any more)
    move to the LRU head, deepest first, so they are evicted before any block of a live chain.

Chains are tracked for prefix-closed groups (full attention) only; window and state groups do not
need their predecessors for a hit. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.ids import BlockHash
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import BlockPool, IntegrityError
from kvtier.offload.types import Key


class HostCache:
    """Host `BlockPool` keyed by (group id, hash), with parent links for chain-aware eviction.

    `is_pending(key)`: whether a store of `key` is in flight (its descendants are not orphans yet).
    """

    def __init__(
        self,
        num_blocks: int,
        is_pending: Callable[[Key], bool],
        enable_kv_events: bool = False,
    ) -> None:
        self.pool = BlockPool(
            num_blocks,
            enable_caching=True,
            enable_quarantine=False,  # host blocks are touched only by copies we track ourselves
            enable_kv_events=enable_kv_events,
            medium="host",
        )
        self._is_pending = is_pending
        self._parent: dict[Key, BlockHash] = {}  # published chained key -> parent hash
        self._children: dict[Key, set[BlockHash]] = {}  # (group, parent hash) -> child hashes
        self._origin: dict[Key, int] = {}  # staged entry -> the lower tier it came from, unused
        self.num_evicted = 0
        self.num_orphans_demoted = 0

    # ---- queries -------------------------------------------------------------------------------

    def get(self, key: Key) -> KVBlock | None:
        return self.pool.get_cached_block(key[0], key[1])

    def contains(self, key: Key) -> bool:
        return self.get(key) is not None

    def take_origin(self, key: Key) -> int | None:
        """The origin `publish` gave a cached entry, once: None after the first call, for an
        entry published without one, and for one evicted since (a later publish is a new entry)."""
        return self._origin.pop(key, None)

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free fresh blocks and evictable cached ones)."""
        return self.pool.num_free_blocks

    def peek_evictions(self, n: int) -> list[Key | None]:
        """Keys the next `n` allocations would evict, in order (None: an unhashed free block)."""
        out: list[Key | None] = []
        for block in self.pool.free_queue:
            if len(out) >= n:
                break
            h = block.block_hash
            out.append(None if h is None else (block.group_id, h))
        return out

    # ---- mutation ------------------------------------------------------------------------------

    def allocate(self, n: int) -> tuple[list[KVBlock], list[Key]]:
        """Pop `n` blocks (ref 1 each) from the LRU head; returns them and the keys evicted."""
        evicted = [k for k in self.peek_evictions(n) if k is not None]
        blocks = self.pool.get_new_blocks(n)
        for key in evicted:
            self._forget(key)
            self.num_evicted += 1
            self._demote_descendants(key)
        return blocks, evicted

    def evict(self, key: Key) -> bool:
        """Drop one entry now (e.g. its host copy is known bad); its descendants become orphans.
        A referenced block stays allocated to its holders, unfindable."""
        block = self.get(key)
        if block is None:
            return False
        self.pool.evict_blocks([block.block_id])
        self._forget(key)
        self.num_evicted += 1
        self._demote_descendants(key)
        return True

    def publish(
        self,
        group_id: int,
        blocks: Sequence[KVBlock],
        hashes: Sequence[BlockHash],
        parents: Sequence[BlockHash | None] | None,
        block_size: int,
        origins: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Insert completed store blocks (ordered head → tail of their chain) into the map and
        drop the store's reference tail-first; orphans among them go straight to the LRU head.
        `origins`: per block, where its bytes came from (a lower tier's index), for `take_origin`.
        `token_ids`: per block, its tokens (for the pool's events; None: not announced)."""
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if origins is not None:
                self._origin[(group_id, block_hash)] = origins[i]
            parent = parents[i] if parents is not None else None
            toks = token_ids[i] if token_ids is not None else None
            self.pool.cache_block(group_id, block, block_hash, parent, block_size, toks)
            if parent is not None:
                self._parent[(group_id, block_hash)] = parent
                self._children.setdefault((group_id, parent), set()).add(block_hash)
        self.pool.free(list(reversed(blocks)))  # rule (a): deepest first = evicted first
        for block_hash in hashes:
            key = (group_id, block_hash)
            parent = self._parent.get(key)
            if parent is not None and self._is_orphan_parent((group_id, parent)):
                self._demote([key])

    def _is_orphan_parent(self, parent: Key) -> bool:
        return not self.contains(parent) and not self._is_pending(parent)

    def _forget(self, key: Key) -> None:
        self._origin.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get((key[0], parent))
            if siblings is not None:
                siblings.discard(key[1])
                if not siblings:
                    del self._children[(key[0], parent)]

    def _demote_descendants(self, key: Key) -> None:
        group_id = key[0]
        self._demote([(group_id, c) for c in self._children.get(key, ())])

    def _demote(self, roots: list[Key]) -> None:
        """Move the cached, unreferenced blocks of `roots` and their descendants to the LRU head,
        deepest first (rule b)."""
        by_depth: list[tuple[int, KVBlock]] = []
        frontier = [(0, k) for k in roots]
        seen: set[Key] = set()
        while frontier:
            depth, key = frontier.pop()
            if key in seen:
                continue
            seen.add(key)
            block = self.get(key)
            if block is not None and block.ref_cnt == 0:
                by_depth.append((depth, block))
            frontier.extend((depth + 1, (key[0], c)) for c in self._children.get(key, ()))
        if not by_depth:
            return
        by_depth.sort(key=lambda t: -t[0])
        moved = [b for _, b in by_depth]
        for block in moved:
            self.pool.free_queue.remove(block)
        self.pool.free_queue.prepend_n(moved)
        self.num_orphans_demoted += len(moved)

    def reset(self) -> bool:
        """Forget every entry (only when no host block is referenced)."""
        if not self.pool.reset_prefix_cache():
            return False
        self._parent.clear()
        self._children.clear()
        self._origin.clear()
        return True

    def check_integrity(self) -> None:
        """Check the pool and the chain links; raises `IntegrityError` naming the broken one."""
        self.pool.check_integrity()
        for key in self._parent:
            if not self.contains(key):
                raise IntegrityError(f"parent link kept for evicted {key[1].hex()[:8]}")
        for key in self._origin:
            if not self.contains(key):
                raise IntegrityError(f"origin kept for evicted {key[1].hex()[:8]}")
        for (g, parent), children in self._children.items():
            if not children:
                raise IntegrityError(f"empty child set kept for {parent.hex()[:8]}")
            for c in children:
                if (g, c) not in self._parent:
                    raise IntegrityError(f"child link to {c.hex()[:8]} without a parent link")
