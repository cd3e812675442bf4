"""Physical KV blocks and the intrusive doubly linked free queue (O(1) removal from the middle).

Owns only block metadata and free-list links; ref counting and caching policy live in `block_pool`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtier.ids import BlockHash, BlockId


class KVBlock:
    """Metadata of one physical block. Links are owned by `FreeBlockQueue`."""

    __slots__ = (
        "block_hash",
        "block_id",
        "group_id",
        "is_null",
        "next_free",
        "prev_free",
        "ref_cnt",
        "token_ids",
    )

    def __init__(self, block_id: BlockId) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only on full, cached blocks: (group id, chained hash). INVARIANT: at most one key.
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        # Set with the hash when its pool emits events: the block's own tokens, which the event
        # of a copy on another tier names too (kv/events.py).
        self.token_ids: tuple[int, ...] | None = None
        self.is_null = False
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}, null={self.is_null})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; head = next to allocate / evict (LRU), tail = MRU.

    INVARIANT: a block is linked iff it is in this queue; sentinels are never handed out.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Remove and return the first n blocks in order. Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        out: list[KVBlock] = []
        curr = self._head.next_free
        for _ in range(n):
            assert curr is not None
            out.append(curr)
            nxt = curr.next_free
            curr.prev_free = curr.next_free = None
            curr = nxt
        self._head.next_free = curr
        assert curr is not None
        curr.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Link `blocks` at the tail in the given order (the last given becomes the new tail)."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Link `blocks` at the head in the given order (the first given becomes the new head)."""
        if not blocks:
            return
        first = self._head.next_free
        assert first is not None
        prev = self._head
        for block in blocks:
            block.prev_free = prev
            prev.next_free = block
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        curr = self._head.next_free
        while curr is not None and curr is not self._tail:
            yield curr
            curr = curr.next_free

    def block_ids(self) -> list[BlockId]:
        """Free block ids from head to tail (for tests and integrity checks)."""
        return [b.block_id for b in self]
