"""Inputs of paged attention: `AttentionMetadata` (one forward's ragged batch: query offsets,
context lengths, per-KV-group block tables and slot mappings) and `LayerKind` (the mask rule of a
group: causal, sliding window or Llama-4 chunks). Plain data; the op lives in `paged.py`."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
        counts = np.array(self.query_lens, dtype=np.int64)
        seq = np.repeat(np.arange(len(counts)), counts)  # [num_tokens]
        first = np.array(self.seq_lens, dtype=np.int64) - counts  # first query position
        starts = np.array(self.query_start_loc[:-1], dtype=np.int64)
        return torch.from_numpy(first[seq] + np.arange(self.query_start_loc[-1]) - starts[seq])

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
        # numpy, not torch: a few dozen small ops per step, where torch's per-op dispatch would
        # cost more than the work itself
        counts = np.fromiter(num_scheduled_tokens, dtype=np.int64, count=len(num_scheduled_tokens))
        computed = np.fromiter(num_computed_tokens, dtype=np.int64, count=len(counts))
        ends = np.cumsum(counts)
        loc = (0, *ends.tolist())
        seq_lens = tuple((computed + counts).tolist())
        seq = np.repeat(np.arange(len(counts)), counts)  # [num_tokens] sequence of each token
        p = computed[seq] + np.arange(loc[-1]) - (ends - counts)[seq]  # positions
        tables, slots = [], []
        for group in block_ids:
            if group is None:
                tables.append(torch.zeros(len(seq_lens), 0, dtype=torch.int64))
                slots.append(torch.full((loc[-1],), -1, dtype=torch.int64))
                continue
            lens = np.fromiter(map(len, group), dtype=np.int64, count=len(group))
            width = max(int(lens.max()) if len(group) else 0, 1)
            table = np.zeros((len(group), width), dtype=np.int64)
            table[np.arange(width) < lens[:, None]] = list(itertools.chain.from_iterable(group))
            tables.append(torch.from_numpy(table))  # [num_seqs, max_blocks]
            slot = table[seq, p // block_size] * block_size + p % block_size  # [num_tokens]
            slots.append(torch.from_numpy(slot))
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

    def first_key(self, query_pos: np.ndarray) -> np.ndarray:
        """Elementwise `kv_start` over int64 positions: the first key each query may read."""
        if self.window is not None:
            first: np.ndarray = np.maximum(query_pos - self.window + 1, 0)
            return first
        if self.chunk is not None:
            return query_pos // self.chunk * self.chunk
        return np.zeros_like(query_pos)

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
