"""FreeBlockQueue: the intrusive doubly linked LRU list (order, O(1) middle removal, batch ops)."""

from __future__ import annotations

import pytest

from kvtier.kv import FreeBlockQueue, KVBlock


def queue(n: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def test_initial_order_is_given_order_and_count_matches():
    q, _ = queue(5)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5


def test_popleft_takes_head_and_unlinks_it():
    q, blocks = queue(3)
    assert q.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert q.block_ids() == [1, 2]
    assert q.num_free_blocks == 2


def test_popleft_on_empty_queue_raises():
    q, _ = queue(1)
    q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_popleft_n_returns_head_blocks_in_order_and_relinks_the_rest():
    q, blocks = queue(6)
    out = q.popleft_n(4)
    assert out == blocks[:4]
    assert all(b.prev_free is None and b.next_free is None for b in out)
    assert q.block_ids() == [4, 5]
    assert q.num_free_blocks == 2
    assert q.popleft_n(0) == [] and q.block_ids() == [4, 5]
    assert q.popleft_n(2) == blocks[4:] and q.block_ids() == []


def test_popleft_n_beyond_free_count_raises_and_leaves_queue_intact():
    q, _ = queue(3)
    with pytest.raises(ValueError, match="asked for 4"):
        q.popleft_n(4)
    assert q.block_ids() == [0, 1, 2] and q.num_free_blocks == 3


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_remove_unlinks_head_middle_or_tail_in_constant_steps(victim):
    q, blocks = queue(5)
    q.remove(blocks[victim])
    assert q.block_ids() == [i for i in range(5) if i != victim]
    assert q.num_free_blocks == 4
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    assert list(reversed(q.block_ids())) == _walk_backwards(q)


def test_remove_of_an_unlinked_block_raises():
    q, blocks = queue(2)
    q.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    assert q.num_free_blocks == 1


def test_append_n_links_at_tail_in_given_order():
    q, _ = queue(5)
    taken = q.popleft_n(3)
    q.append_n([taken[2], taken[0]])
    assert q.block_ids() == [3, 4, 2, 0]
    assert q.num_free_blocks == 4
    assert list(reversed(q.block_ids())) == _walk_backwards(q)


def test_prepend_n_puts_first_given_at_head():
    q, _ = queue(5)
    taken = q.popleft_n(3)
    q.prepend_n([taken[2], taken[1]])
    assert q.block_ids() == [2, 1, 3, 4]
    assert list(reversed(q.block_ids())) == _walk_backwards(q)


def test_batch_ops_on_empty_queue_and_empty_batches():
    q, blocks = queue(2)
    q.popleft_n(2)
    q.append_n([])
    q.prepend_n([])
    assert q.block_ids() == [] and q.num_free_blocks == 0
    q.prepend_n([blocks[1]])
    q.append_n([blocks[0]])
    assert q.block_ids() == [1, 0]
    assert list(reversed(q.block_ids())) == _walk_backwards(q)


def _walk_backwards(q: FreeBlockQueue) -> list[int]:
    """Follow prev links from the tail sentinel (checks the back links the iterator never reads)."""
    out = []
    curr = q._tail.prev_free
    while curr is not None and curr is not q._head:
        out.append(curr.block_id)
        curr = curr.prev_free
    return out
