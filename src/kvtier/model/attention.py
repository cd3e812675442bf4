"""Inputs of paged attention: `AttentionMetadata` (one forward's ragged batch: query offsets,
context lengths, per-KV-group block tables and slot mappings) and `LayerKind` (the mask rule of a
group: causal, sliding window or Llama-4 chunks). Plain data; the op lives in `paged.py`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One forward's ragged batch. Each sequence's queries are its last `query_len` positions,
    contiguous in the batch from `query_start_loc[i]`; sequences may be prefill chunks or decodes."""

    query_start_loc: tuple[int, ...]  # [num_seqs + 1] token offsets; the last is num_tokens
    seq_lens: tuple[int, ...]  # [num_seqs] context length once this forward's tokens are in
    block_tables: tuple[torch.Tensor, ...]  # per KV group: [num_seqs, max_blocks] int64 block ids
    slot_mappings: tuple[torch.Tensor, ...]  # per KV group: [num_tokens] int64; -1 = don't write
    block_size: int

    def __post_init__(self) -> None:
        assert len(self.query_start_loc) == len(self.seq_lens) + 1
        assert len(self.block_tables) == len(self.slot_mappings)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @functools.cached_property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc
        return [loc[i + 1] - loc[i] for i in range(len(self.seq_lens))]

    def query_positions(self) -> torch.Tensor:
        """[num_tokens] int64 position of every query token (what `positions` must hold)."""
        counts = torch.tensor(self.query_lens, dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(len(self.seq_lens)), counts)  # [num_tokens]
        first = torch.tensor(self.seq_lens, dtype=torch.int64) - counts  # first query position
        starts = torch.tensor(self.query_start_loc[:-1], dtype=torch.int64)
        return first[seq] + torch.arange(self.query_start_loc[-1]) - starts[seq]

    @classmethod
    def build(
        cls,
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        block_ids: Sequence[Sequence[Sequence[int]] | None],
        block_size: int,
    ) -> AttentionMetadata:
        """From per-sequence counts and `block_ids[group][seq]` (block id per table position;
        0 = null block for positions a window no longer reads). A group given as None holds no
        attention (a Mamba state group): an empty table, and no slot is written."""
        loc = [0]
        for n in num_scheduled_tokens:
            loc.append(loc[-1] + n)
        seq_lens = tuple(
            c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)
        )
        counts = torch.tensor(list(num_scheduled_tokens), dtype=torch.int64)  # [num_seqs]
        seq = torch.repeat_interleave(torch.arange(len(seq_lens)), counts)  # [num_tokens]
        offset = torch.arange(loc[-1]) - torch.tensor(loc[:-1], dtype=torch.int64)[seq]
        p = torch.tensor(list(num_computed_tokens), dtype=torch.int64)[seq] + offset  # positions
        tables, slots = [], []
        for group in block_ids:
            if group is None:
                tables.append(torch.zeros(len(seq_lens), 0, dtype=torch.int64))
                slots.append(torch.full((loc[-1],), -1, dtype=torch.int64))
                continue
            width = max([len(ids) for ids in group] + [1])
            padded = [list(ids) + [0] * (width - len(ids)) for ids in group]
            table = torch.tensor(padded, dtype=torch.int64).reshape(len(group), width)
            tables.append(table)  # [num_seqs, max_blocks]
            slots.append(table[seq, p // block_size] * block_size + p % block_size)  # [num_tokens]
        return cls(tuple(loc), seq_lens, tuple(tables), tuple(slots), block_size)


@dataclass(frozen=True)
class LayerKind:
    """Mask rule of a KV group: full causal, sliding window of `window`, or chunks of `chunk`."""

    window: int | None = None
    chunk: int | None = None

    def kv_start(self, first_query_pos: int) -> int:
        """First key position any query at or after `first_query_pos` may read."""
        if self.window is not None:
            return max(0, first_query_pos - self.window + 1)
        if self.chunk is not None:
            return first_query_pos // self.chunk * self.chunk
        return 0

    def first_key(self, query_pos: torch.Tensor) -> torch.Tensor:
        """Elementwise `kv_start`: the first key position each query may read."""
        if self.window is not None:
            return (query_pos - self.window + 1).clamp(min=0)
        if self.chunk is not None:
            return query_pos // self.chunk * self.chunk
        return torch.zeros_like(query_pos)

    def mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[num_queries, num_keys] bool: True where the query may attend the key."""
        return self.allowed(query_pos[:, None], key_pos[None, :])

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Elementwise over broadcastable query and key positions."""
        allowed = k <= q
        if self.window is not None:
            allowed &= k > q - self.window
        if self.chunk is not None:
            allowed &= k // self.chunk == q // self.chunk
        return allowed
