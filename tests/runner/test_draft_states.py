"""runner/draft_states.py: where a verification step sends the state after each of its tokens,
and where the state of the last accepted token lands (architecture.md §Rollback)."""

from __future__ import annotations

import pytest
import torch

from kvtier.runner.draft_states import DraftStates

# KV groups: 0 attention, 1 state (block size 8); the draft pages start at row 100
TABLES = [[5, 6, 7], [0, 11, 12]]  # the state group's table: positions 1 and 2 real


def drafts(k: int = 3) -> DraftStates:
    return DraftStates(100, k, [1], [8, 8], max_num_seqs=4)


def test_each_token_but_the_last_has_a_draft_page_the_last_the_end_page() -> None:
    # start 14 (page 1), one real token and 3 drafts: positions 14..17, end 18 (page 2)
    slots = drafts().token_slots(2, 14, 1, 3, TABLES)
    assert slots == {1: [106, 107, 108, 12]}  # sequence 2's pages 106-108, then table[17 // 8]
    # two real tokens (a resumed request): the first shares the page of the last real one
    assert drafts().token_slots(0, 13, 2, 2, TABLES) == {1: [100, 100, 101, 12]}


def test_the_last_accepted_state_lands_on_the_page_of_the_new_count() -> None:
    pool = [torch.arange(120.0)[:, None].repeat(1, 2) for _ in range(2)]  # two layer slots
    # start 14, 1 real + 3 drafts, one accepted: last accepted token index 1, n' = 16 → page 1
    drafts().land(pool, [(2, 14, 0, 1, TABLES)], torch.device("cpu"))
    for slot in pool:
        assert slot[11].tolist() == [107.0, 107.0]  # the state after token 1 (draft page 107)
        assert slot[12].tolist() == [12.0, 12.0]  # the end page is left alone


def test_a_step_longer_than_a_state_block_is_refused() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens 8"):
        DraftStates(100, 8, [1], [8, 8], max_num_seqs=4)
