"""Draft pages: a hybrid's recurrent state after each drafted token of a verification step, so a
rejected draft leaves the state exactly as if the rejected tokens never ran
(architecture.md §Rollback).

Attention rolls back by position; a Mamba state after a verification step has seen every drafted
token. A step with drafts therefore runs its state groups token by token (`StateMetadata`
`token_slots`): the state after its last token goes to the page the addressing rule names for its
end, the states after the tokens that may be the last accepted one go to draft pages. Once the
forward has accepted its drafts (in the same op), the draft page of the last accepted token is
copied to the table page the rule names for the device's new count n′, table[(n′ − 1) // bs],
which the next step (scheduled before the host knew n′) reads as its start.

Draft pages are rows of the device pool beyond the blocks the KV manager owns: k per sequence
with drafts and state group, written and read only inside the forward op that verifies them (on
the compute stream, declared in its access set), so they need no lifetime of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.runner.state import host_index


class DraftStates:
    """The draft pages of one runner: `k` per (draft sequence of a step, state group)."""

    def __init__(
        self,
        first_page: int,
        num_speculative_tokens: int,
        state_groups: Sequence[int],
        group_block_sizes: Sequence[int],
        max_num_seqs: int,
    ) -> None:
        self.first_page = first_page
        self.k = num_speculative_tokens
        self.state_groups = tuple(state_groups)
        self.block_sizes = {g: group_block_sizes[g] for g in self.state_groups}
        self.max_num_seqs = max_num_seqs
        for g, bs in self.block_sizes.items():
            if self.k + 1 > bs:
                raise ValueError(
                    f"num_speculative_tokens {self.k}: a verification step of {self.k + 1} "
                    f"tokens must fit one state block of {bs} tokens (group {g}); use at most "
                    f"{bs - 1} speculative tokens or a larger --block-size"
                )

    @staticmethod
    def num_pages(num_state_groups: int, num_speculative_tokens: int, max_num_seqs: int) -> int:
        """Pool rows the draft pages take beyond the KV manager's blocks."""
        return num_state_groups * num_speculative_tokens * max_num_seqs

    @property
    def enabled(self) -> bool:
        return bool(self.state_groups) and self.k > 0

    def pages(self, seq: int, group_index: int) -> list[int]:
        """The k draft pages of the step's `seq`-th sequence with drafts, state group index."""
        assert seq < self.max_num_seqs
        base = self.first_page + (seq * len(self.state_groups) + group_index) * self.k
        return list(range(base, base + self.k))

    def all_pages(self, num_draft_seqs: int) -> list[int]:
        """Every draft page a step with `num_draft_seqs` drafting sequences writes."""
        return [
            p
            for q in range(num_draft_seqs)
            for gi in range(len(self.state_groups))
            for p in self.pages(q, gi)
        ]

    def token_slots(
        self, seq: int, start: int, num_real: int, num_drafts: int, tables: Sequence[list[int]]
    ) -> dict[int, list[int]]:
        """Per state group, a page for the state after each of the sequence's step tokens: draft
        pages for the tokens that may be the last accepted one (the last real token and every
        draft but the last; earlier real tokens share the first), the table page of the step's
        end for the last. `tables`: the sequence's block table per KV group."""
        n = num_real + num_drafts
        first = max(num_real - 1, 0)  # token index of the last real token
        out: dict[int, list[int]] = {}
        for gi, g in enumerate(self.state_groups):
            pages = self.pages(seq, gi)
            slots = [pages[max(j - first, 0)] for j in range(n - 1)]
            out[g] = [*slots, tables[g][(start + n - 1) // self.block_sizes[g]]]
        return out

    def land(
        self,
        pool: Sequence[torch.Tensor],
        landings: Sequence[tuple[int, int, int, int, Sequence[list[int]]]],
        device: torch.device,
    ) -> None:
        """Copy the state after each sequence's last accepted token to its table page.
        `landings`: (seq, start, last real token index, last accepted token index, tables) of
        each drafting sequence whose last accepted token is not its step's last (mutates
        `pool`)."""
        src: list[int] = []
        dst: list[int] = []
        for seq, start, first, j, tables in landings:
            for gi, g in enumerate(self.state_groups):
                src.append(self.pages(seq, gi)[j - first])
                dst.append(tables[g][(start + j) // self.block_sizes[g]])
        if not src:
            return
        src_t, dst_t = host_index(src, device), host_index(dst, device)
        for slot in pool:  # a block id's page in every layer slot belongs to its group
            # as bytes: a page holds a state in the run's dtype whatever K/V's (8-bit pools
            # included, whose float8 dtypes torch's cpu index_copy_ does not take)
            pages = slot.view(torch.uint8)
            pages.index_copy_(0, dst_t, pages.index_select(0, src_t))
