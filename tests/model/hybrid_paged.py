"""Test driver for the hybrid models: one pool of block ids shared by every KV group, as the engine
has. Attention groups keep every block; a Mamba group keeps one real block, at the table position
of the last computed token (kv/specs.py `Mamba`): a step that crosses a block boundary reads its
state from the old block and writes it to a new one, and the old block is freed and filled with NaN
(so a stray read of a freed state or of a fresh block shows as NaN)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.model.attention import AttentionMetadata
from kvtier.model.hybrid import HybridLM
from kvtier.model.mamba2 import MambaCache, StateMetadata


@dataclass
class HybridKV:
    """Owns the KV and state pools of one hybrid model; sequences are named by str ids."""

    model: HybridLM
    num_blocks: int
    block_size: int
    poison: bool = True
    kv_dtype: torch.dtype | None = None  # the attention caches' (None: the model's); fp8: 8-bit
    kv_caches: dict[int, torch.Tensor] = field(init=False)
    state_caches: dict[int, MambaCache] = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # seq -> per group ids
    num_computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_caches = self.model.allocate_kv_caches(
            self.num_blocks, self.block_size, self.kv_dtype
        )
        self.state_caches = self.model.allocate_state_caches(self.num_blocks)
        self.free = list(range(self.num_blocks - 1, 0, -1))  # block 0 is the null block
        for b in self.free:
            self._poison(b)  # nothing may read a block before writing it

    @property
    def state_groups(self) -> list[int]:
        return sorted(set(self.model.state_group.values()))

    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over `(seq id, new token ids)` pairs; logits [n_i, vocab] per entry."""
        computed, scheduled = [], []
        for seq, ids in batch:
            done = self.num_computed.setdefault(seq, 0)
            tables = self.tables.setdefault(seq, [[] for _ in self.model.kv_groups])
            end = done + len(ids)
            for g, table in enumerate(tables):
                if g in self.state_groups:
                    last = (end - 1) // self.block_size if end else -1
                    while len(table) <= last:  # skipped positions hold the null block
                        table.append(self.free.pop() if len(table) == last else 0)
                else:
                    while len(table) < -(-end // self.block_size):
                        table.append(self.free.pop())
            computed.append(done)
            scheduled.append(len(ids))
        groups = range(len(self.model.kv_groups))
        block_ids = [[self.tables[seq][g] for seq, _ in batch] for g in groups]
        meta = AttentionMetadata.build(computed, scheduled, block_ids, self.block_size)
        states = {g: block_ids[g] for g in self.state_groups}
        state_meta = StateMetadata.build(computed, scheduled, states, self.block_size)
        input_ids = torch.tensor([t for _, ids in batch for t in ids], dtype=torch.long)
        with torch.no_grad():
            hidden = self.model(
                input_ids,
                meta.query_positions(),
                self.kv_caches,
                meta,
                self.state_caches,
                state_meta,
            )
            logits = self.model.compute_logits(hidden)
        for seq, ids in batch:
            self.num_computed[seq] += len(ids)
            self._prune(seq)
        return list(logits.split(scheduled))

    def verify(self, seq: str, tokens: list[int], num_accepted: int) -> torch.Tensor:
        """A draft-verification step: `tokens` (the last sampled token, then drafts) run with the
        state after each token sent to a scratch block, then only 1 + `num_accepted` of them are
        kept: the state after the last kept token is copied to the table's block for that count
        (what the runner does once verification is known) and the scratch blocks are freed.
        Returns the logits [len(tokens), vocab]."""
        done, bs = self.num_computed[seq], self.block_size
        end = done + len(tokens)
        tables = self.tables[seq]
        for g, table in enumerate(tables):
            if g not in self.state_groups:
                while len(table) < -(-end // bs):
                    table.append(self.free.pop())
        scratch = {g: [self.free.pop() for _ in tokens] for g in self.state_groups}
        groups = range(len(self.model.kv_groups))
        width = -(-end // bs)  # state tables stay as they are; attention ignores them
        block_ids = [[tables[g] + [0] * (width - len(tables[g]))] for g in groups]
        meta = AttentionMetadata.build([done], [len(tokens)], block_ids, bs)
        state_meta = StateMetadata.build(
            [done],
            [len(tokens)],
            {g: block_ids[g] for g in self.state_groups},  # dst unused: a slot per token
            bs,
            token_slots={g: {0: slots} for g, slots in scratch.items()},
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(tokens, dtype=torch.long),
                meta.query_positions(),
                self.kv_caches,
                meta,
                self.state_caches,
                state_meta,
            )
            logits = self.model.compute_logits(hidden)
        kept = done + 1 + num_accepted
        last = (kept - 1) // bs
        for g in self.state_groups:
            table = tables[g]
            while len(table) <= last:
                table.append(self.free.pop() if len(table) == last else 0)
            for layer, group in self.model.state_group.items():
                if group == g:
                    state = self.state_caches[layer]
                    state.conv[table[last]] = state.conv[scratch[g][num_accepted]]
                    state.ssm[table[last]] = state.ssm[scratch[g][num_accepted]]
            for block in scratch[g]:
                self._free(block)
        self.num_computed[seq] = kept
        self._prune(seq)
        return logits

    def release(self, seq: str) -> None:
        for table in self.tables.pop(seq):
            for b in table:
                if b:
                    self._free(b)
        del self.num_computed[seq]

    def _prune(self, seq: str) -> None:
        """Free each Mamba group's state blocks before the last computed token's position."""
        last = (self.num_computed[seq] - 1) // self.block_size
        for g in self.state_groups:
            table = self.tables[seq][g]
            for j in range(min(last, len(table))):
                if table[j]:
                    self._free(table[j])
                    table[j] = 0

    def _free(self, block: int) -> None:
        self._poison(block)
        self.free.append(block)

    def _poison(self, block: int) -> None:
        if not self.poison:
            return
        for cache in self.kv_caches.values():
            cache[block] = float("nan")
        for state in self.state_caches.values():
            state.conv[block] = float("nan")
            state.ssm[block] = float("nan")
