"""Paged attention in torch: `AttentionMetadata` (the per-forward inputs), per-KV-group gather plans
(built once per forward, shared by the group's layers) and the layer op: write the new K/V by slot
mapping, gather each sequence's window of keys by block table, attend with causal/window/chunk masks.

A KV tensor is [num_blocks, 2, block_size, num_kv_heads, head_dim] (`device.types.KVLayout`); viewed
as token rows [num_blocks * 2 * block_size, kv_heads * head_dim], the key of slot s = b * bs + o is
row 2 * bs * b + o and its value sits block_size rows later. Reads gather per-head rows
[.., head_dim] so keys come out [.., kv_heads, len, head_dim] contiguous. No state between forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    @property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc
        return [loc[i + 1] - loc[i] for i in range(len(self.seq_lens))]

    def query_positions(self) -> torch.Tensor:
        """[num_tokens] int64 position of every query token (what `positions` must hold)."""
        parts = [
            torch.arange(n - q, n) for n, q in zip(self.seq_lens, self.query_lens, strict=True)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    @classmethod
    def build(
        cls,
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        block_ids: Sequence[Sequence[Sequence[int]]],
        block_size: int,
    ) -> AttentionMetadata:
        """From per-sequence counts and `block_ids[group][seq]` (block id per table position;
        0 = null block for positions a window no longer reads)."""
        loc = [0]
        for n in num_scheduled_tokens:
            loc.append(loc[-1] + n)
        seq_lens = tuple(
            c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)
        )
        tables, slots = [], []
        for group in block_ids:
            width = max([len(ids) for ids in group] + [1])
            table = torch.zeros(len(group), width, dtype=torch.int64)  # [num_seqs, max_blocks]
            for i, ids in enumerate(group):
                table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            tables.append(table)
            pos = [
                torch.arange(c, c + n)
                for c, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)
            ]
            seq = torch.repeat_interleave(
                torch.arange(len(group)), torch.tensor(list(num_scheduled_tokens))
            )
            p = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
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

    def mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[num_queries, num_keys] bool: True where the query may attend the key."""
        q, k = query_pos[:, None], key_pos[None, :]
        allowed = k <= q
        if self.window is not None:
            allowed &= k > q - self.window
        if self.chunk is not None:
            allowed &= k // self.chunk == q // self.chunk
        return allowed


@dataclass
class GroupPlan:
    """Index tensors of one KV group for one forward; shared by every layer of the group."""

    block_size: int
    write_tokens: torch.Tensor | None  # [num_written] token indices; None = every token
    write_rows: torch.Tensor  # [num_written] token rows of the keys to write
    decode_tokens: torch.Tensor | None  # [num_decodes] token indices; None = no decodes
    decode_all: bool  # every token is a decode, in order: skip the token gather/scatter
    decode_rows: torch.Tensor  # [num_decodes * KVH * max_len] head rows (padding repeats one)
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_len] bool
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # start, end, rows [KVH*L], mask


def plan_group(
    meta: AttentionMetadata, group: int, kind: LayerKind, num_kv_heads: int, num_queries_per_kv: int
) -> GroupPlan:
    """Precompute writes and gathers of `group`; prefill masks are [G * q, L] for GQA packing."""
    bs = meta.block_size
    heads = torch.arange(num_kv_heads)
    table, slots = meta.block_tables[group], meta.slot_mappings[group]
    write_tokens = None
    if slots.numel() and bool((slots < 0).any()):
        write_tokens = torch.nonzero(slots >= 0).flatten()
        slots = slots[write_tokens]
    write_rows = slots + slots // bs * bs
    qlens, seq_lens, loc = meta.query_lens, meta.seq_lens, meta.query_start_loc
    dec = [i for i, q in enumerate(qlens) if q == 1]
    plan = GroupPlan(bs, write_tokens, write_rows, None, False, write_rows, write_rows, [])
    if dec:
        lens = torch.tensor([seq_lens[i] for i in dec])  # [num_decodes]
        starts = torch.tensor([kind.kv_start(seq_lens[i] - 1) for i in dec])
        width = int((lens - starts).max())
        pos = starts[:, None] + torch.arange(width)[None, :]  # [num_decodes, width]
        valid = pos < lens[:, None]
        pos = torch.minimum(pos, lens[:, None] - 1)
        rows_table = table if len(dec) == len(qlens) else table[torch.tensor(dec)]
        blocks = rows_table.gather(1, pos // bs)
        plan.decode_all = len(dec) == len(qlens)
        plan.decode_tokens = torch.tensor([loc[i] for i in dec])
        token_rows = blocks * (2 * bs) + pos % bs  # [num_decodes, width]
        plan.decode_rows = (token_rows[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        plan.decode_mask = valid[:, None, None, :]
    for i, q in enumerate(qlens):
        if q <= 1:
            continue
        first = seq_lens[i] - q
        start = kind.kv_start(first)
        pos = torch.arange(start, seq_lens[i])  # [L]
        token_rows = table[i, pos // bs] * (2 * bs) + pos % bs  # [L]
        rows = (token_rows[None, :] * num_kv_heads + heads[:, None]).flatten()  # [KVH * L]
        mask = kind.mask(torch.arange(first, seq_lens[i]), pos).repeat(num_queries_per_kv, 1)
        plan.prefills.append((loc[i], loc[i + 1], rows, mask))
    return plan


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: GroupPlan,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] → [T, H, D]; writes k/v into `kv_cache` first."""
    num_tokens, num_heads, dim = q.shape
    kvh = k.shape[1]
    group = num_heads // kvh
    bs = plan.block_size
    flat = kv_cache.view(-1, kvh * dim)  # token rows [num_blocks * 2 * block_size, KVH * D]
    head_rows = kv_cache.view(-1, dim)  # head rows [num_blocks * 2 * block_size * KVH, D]
    v_off = bs * kvh
    if plan.write_tokens is not None:
        k, v = k[plan.write_tokens], v[plan.write_tokens]
    flat.index_copy_(0, plan.write_rows, k.reshape(-1, kvh * dim).to(flat.dtype))
    flat.index_copy_(0, plan.write_rows + bs, v.reshape(-1, kvh * dim).to(flat.dtype))
    out = q.new_empty(num_tokens, num_heads, dim)
    if plan.decode_tokens is not None:
        n = plan.decode_mask.shape[0]
        qd = q if plan.decode_all else q[plan.decode_tokens]
        qd = qd.view(n, kvh, group, dim)
        kd = head_rows.index_select(0, plan.decode_rows).view(n, kvh, -1, dim)  # [n, KVH, L, D]
        vd = head_rows.index_select(0, plan.decode_rows + v_off).view(n, kvh, -1, dim)
        # Few queries per sequence: plain matmuls beat SDPA's per-call setup here.
        od = _attend_eager(qd, kd.to(q.dtype), vd.to(q.dtype), plan.decode_mask, scale, softcap)
        if plan.decode_all:
            out = od.reshape(num_tokens, num_heads, dim)
        else:
            out[plan.decode_tokens] = od.reshape(n, num_heads, dim)
    for start, end, rows, mask in plan.prefills:
        n = end - start
        qp = q[start:end].view(n, kvh, group, dim).permute(1, 2, 0, 3).reshape(kvh, group * n, dim)
        kp = head_rows.index_select(0, rows).view(kvh, -1, dim).to(q.dtype)  # [KVH, L, D]
        vp = head_rows.index_select(0, rows + v_off).view(kvh, -1, dim).to(q.dtype)
        if softcap is None:  # [KVH, G * n, D]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        else:
            op = _attend_eager(qp, kp, vp, mask, scale, softcap)
        out[start:end] = op.view(kvh, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
    return out


def _attend_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """softmax(mask(cap(q k^T * scale))) v with the softmax in at least float32 (as HF eager)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
    return torch.matmul(probs.to(q.dtype), v)
