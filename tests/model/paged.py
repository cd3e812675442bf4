"""Test driver for the paged model: a simple block allocator per KV group that frees (and poisons
with NaN) blocks a window or chunk no longer reads, and a step function for ragged batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvtier.model.attention import AttentionMetadata
from kvtier.model.fused_layer import FusedLayers
from kvtier.model.transformer import CausalLM


@dataclass
class PagedKV:
    """Owns the KV pool of one model; sequences are named by str ids."""

    model: CausalLM
    num_blocks: int
    block_size: int
    poison: bool = True
    kv_dtype: torch.dtype | None = None  # the pool's (None: the model's); fp8 for 8-bit KV
    kv_caches: list[torch.Tensor] = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # seq -> per group ids
    num_computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_caches = self.model.allocate_kv_caches(
            self.num_blocks, self.block_size, self.kv_dtype
        )
        self.free = list(range(self.num_blocks - 1, 0, -1))  # block 0 is the null block

    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over `(seq id, new token ids)` pairs; logits [n_i, vocab] per entry."""
        computed, scheduled = [], []
        for seq, ids in batch:
            done = self.num_computed.setdefault(seq, 0)
            tables = self.tables.setdefault(seq, [[] for _ in self.model.kv_groups])
            need = -(-(done + len(ids)) // self.block_size)
            for table in tables:
                while len(table) < need:
                    table.append(self.free.pop())
            computed.append(done)
            scheduled.append(len(ids))
        block_ids = [
            [self.tables[seq][g] for seq, _ in batch] for g in range(len(self.model.kv_groups))
        ]
        meta = AttentionMetadata.build(computed, scheduled, block_ids, self.block_size)
        input_ids = torch.tensor([t for _, ids in batch for t in ids])
        with torch.no_grad():
            hidden = self.model(input_ids, meta.query_positions(), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        for (seq, ids), _ in zip(batch, computed, strict=True):
            self.num_computed[seq] += len(ids)
            self._prune(seq)
        return list(logits.split(scheduled))

    def release(self, seq: str) -> None:
        for table in self.tables.pop(seq):
            for b in table:
                if b:
                    self._free(b)
        del self.num_computed[seq]

    def _prune(self, seq: str) -> None:
        """Null out blocks wholly before what the next query of each window/chunk group reads."""
        for g, kind in enumerate(self.model.group_kinds):
            start = kind.kv_start(self.num_computed[seq])
            table = self.tables[seq][g]
            for j in range(start // self.block_size):
                if table[j]:
                    self._free(table[j])
                    table[j] = 0

    def _free(self, block: int) -> None:
        if self.poison:
            for cache in self.kv_caches:
                cache[block] = float("nan")
        self.free.append(block)


def record_fused_runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each forward's layers ran as one native call each (`FusedLayers.run` did not
    decline), appended per forward from now on."""
    served: list[bool] = []
    run = FusedLayers.run

    def recording(self: FusedLayers, *args: object, **kwargs: object) -> object:
        done = run(self, *args, **kwargs)  # type: ignore[arg-type]
        served.append(done is not None)
        return done

    monkeypatch.setattr(FusedLayers, "run", recording)
    return served
