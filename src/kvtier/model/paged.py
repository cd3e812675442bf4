"""The paged attention op: per-KV-group gather plans (built once per forward, shared by the group's
layers) and the layer step — write the new K/V by slot mapping, gather each sequence's readable keys
by block table, attend with causal/window/chunk masks. Holds no state between forwards.

A KV tensor is [num_blocks, 2, block_size, num_kv_heads, head_dim] (`device.types.KVLayout`). As
token rows [num_blocks * 2 * block_size, kv_heads * head_dim] the key of slot s = b * bs + o is row
2 * bs * b + o and its value block_size rows later; reads gather per-head rows [.., head_dim] so keys
come out [.., kv_heads, len, head_dim] contiguous. Sequences with at most MAX_BATCHED_QUERY queries
(decodes, draft verification) share one padded batched call; longer prefill chunks go one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.model.attention import AttentionMetadata, LayerKind

MAX_BATCHED_QUERY = 8


@dataclass(frozen=True)
class BatchedPlan:
    """Sequences with few queries, each padded to `num_queries`, attended in one call."""

    num_seqs: int
    num_queries: int  # Q
    in_order: bool  # Q == 1 and these are all the tokens, in order: no query gather/scatter
    query_tokens: torch.Tensor  # [n * Q] token of each padded query (padding repeats the last)
    out_rows: torch.Tensor  # [num_real] rows of the padded output that are real queries
    out_tokens: torch.Tensor  # [num_real] their token indices
    rows: torch.Tensor  # [n * KVH * width] head rows of the keys (padding repeats the last)
    mask: torch.Tensor  # [n, 1, G * Q, width] bool, query rows ordered (g, q); [n,1,1,w] if Q = 1


@dataclass(frozen=True)
class PrefillPlan:
    """Longer query chunks of equal (queries, keys) shape, attended together in one SDPA call."""

    num_queries: int  # q per sequence
    tokens: torch.Tensor  # [B * q] token indices, sequence-major
    rows: torch.Tensor  # [B * KVH * L] head rows of the keys
    mask: torch.Tensor  # [B, 1, G * q, L] bool, query rows ordered (g, q)


@dataclass(frozen=True)
class GroupPlan:
    """Index tensors of one KV group for one forward; shared by every layer of the group."""

    block_size: int
    write_tokens: torch.Tensor | None  # [num_written] token indices; None = every token
    write_rows: torch.Tensor  # [num_written] token rows of the keys to write
    batched: BatchedPlan | None
    prefills: list[PrefillPlan]

    def to(self, device: torch.device) -> GroupPlan:
        """The plan with its index tensors on `device` (plans are built on the host)."""
        if device.type == "cpu":
            return self
        batched = self.batched
        if batched is not None:
            moved: dict[str, Any] = {}
            for f in fields(batched):
                value = getattr(batched, f.name)
                moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
            batched = BatchedPlan(**moved)
        return replace(
            self,
            write_tokens=None if self.write_tokens is None else self.write_tokens.to(device),
            write_rows=self.write_rows.to(device),
            batched=batched,
            prefills=[
                PrefillPlan(
                    p.num_queries, p.tokens.to(device), p.rows.to(device), p.mask.to(device)
                )
                for p in self.prefills
            ],
        )


def plan_group(
    meta: AttentionMetadata, group: int, kind: LayerKind, num_kv_heads: int, num_queries_per_kv: int
) -> GroupPlan:
    """Precompute the writes and gathers of KV group `group` for this forward (on the host)."""
    bs = meta.block_size
    heads = torch.arange(num_kv_heads)
    table, slots = meta.block_tables[group].cpu(), meta.slot_mappings[group].cpu()
    write_tokens = None
    if slots.numel() and bool((slots < 0).any()):
        write_tokens = torch.nonzero(slots >= 0).flatten()
        slots = slots[write_tokens]
    write_rows = slots + slots // bs * bs
    qlens, seq_lens, loc = meta.query_lens, meta.seq_lens, meta.query_start_loc
    short = [i for i, q in enumerate(qlens) if 0 < q <= MAX_BATCHED_QUERY]
    batched = _plan_batched(meta, short, table, kind, heads, num_queries_per_kv) if short else None
    shapes: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for i, q in enumerate(qlens):
        if q <= MAX_BATCHED_QUERY:
            continue
        first = seq_lens[i] - q
        pos = torch.arange(kind.kv_start(first), seq_lens[i])  # [L]
        token_rows = table[i, pos // bs] * (2 * bs) + pos % bs  # [L]
        rows = (token_rows[None, :] * num_kv_heads + heads[:, None]).flatten()  # [KVH * L]
        mask = kind.mask(torch.arange(first, seq_lens[i]), pos).repeat(num_queries_per_kv, 1)
        tokens = torch.arange(loc[i], loc[i + 1])
        shapes.setdefault((q, len(pos)), []).append((tokens, rows, mask))  # mask [G * q, L]
    prefills = [
        PrefillPlan(
            q,
            torch.cat([t for t, _, _ in items]),
            torch.cat([r for _, r, _ in items]),
            torch.stack([m for _, _, m in items])[:, None],
        )
        for (q, _), items in shapes.items()
    ]
    return GroupPlan(bs, write_tokens, write_rows, batched, prefills)


def _plan_batched(
    meta: AttentionMetadata,
    seqs: list[int],
    table: torch.Tensor,
    kind: LayerKind,
    heads: torch.Tensor,
    group: int,
) -> BatchedPlan:
    bs = meta.block_size
    all_qlens = meta.query_lens
    qlens = torch.tensor([all_qlens[i] for i in seqs])  # [n]
    lens = torch.tensor([meta.seq_lens[i] for i in seqs])
    starts = torch.tensor([kind.kv_start(meta.seq_lens[i] - all_qlens[i]) for i in seqs])
    num_q, width = int(qlens.max()), int((lens - starts).max())
    j = torch.arange(num_q)[None, :]
    q_off = torch.minimum(j, qlens[:, None] - 1)  # [n, Q]
    q_pos = lens[:, None] - qlens[:, None] + q_off
    query_tokens = torch.tensor([meta.query_start_loc[i] for i in seqs])[:, None] + q_off
    real = (j < qlens[:, None]).flatten()
    k_pos = starts[:, None] + torch.arange(width)[None, :]  # [n, width]
    k_valid = k_pos < lens[:, None]
    k_pos = torch.minimum(k_pos, lens[:, None] - 1)
    seq_table = table if len(seqs) == len(meta.seq_lens) else table[torch.tensor(seqs)]
    token_rows = seq_table.gather(1, k_pos // bs) * (2 * bs) + k_pos % bs  # [n, width]
    rows = (token_rows[:, None, :] * len(heads) + heads[None, :, None]).flatten()
    mask = kind.allowed(q_pos[:, :, None], k_pos[:, None, :]) & k_valid[:, None, :]  # [n, Q, w]
    mask = mask[:, None] if num_q == 1 else mask.repeat(1, group, 1)[:, None]
    return BatchedPlan(
        num_seqs=len(seqs),
        num_queries=num_q,
        in_order=num_q == 1 and len(seqs) == len(meta.seq_lens),
        query_tokens=query_tokens.flatten(),
        out_rows=torch.nonzero(real).flatten(),
        out_tokens=query_tokens.flatten()[real],
        rows=rows,
        mask=mask,
    )


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
    if (b := plan.batched) is not None:
        n, nq = b.num_seqs, b.num_queries
        qb = q if b.in_order else q.index_select(0, b.query_tokens)  # [n * Q, H, D]
        qb = qb.view(n, nq, kvh, group, dim).permute(0, 2, 3, 1, 4).reshape(n, kvh, -1, dim)
        kb = head_rows.index_select(0, b.rows).view(n, kvh, -1, dim).to(q.dtype)  # [n, KVH, w, D]
        vb = head_rows.index_select(0, b.rows + v_off).view(n, kvh, -1, dim).to(q.dtype)
        # Few queries per sequence: plain matmuls beat SDPA's per-call setup here.
        ob = _attend_eager(qb, kb, vb, b.mask, scale, softcap)  # [n, KVH, G * Q, D]
        ob = ob.view(n, kvh, group, nq, dim).permute(0, 3, 1, 2, 4).reshape(n * nq, num_heads, dim)
        if b.in_order:
            out = ob
        else:
            out.index_copy_(0, b.out_tokens, ob.index_select(0, b.out_rows))
    for p in plan.prefills:
        nb, n = p.mask.shape[0], p.num_queries
        qp = q.index_select(0, p.tokens).view(nb, n, kvh, group, dim)
        qp = qp.permute(0, 2, 3, 1, 4).reshape(nb, kvh, group * n, dim)
        kp = head_rows.index_select(0, p.rows).view(nb, kvh, -1, dim).to(q.dtype)  # [B, KVH, L, D]
        vp = head_rows.index_select(0, p.rows + v_off).view(nb, kvh, -1, dim).to(q.dtype)
        if softcap is None:  # [B, KVH, G * n, D]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale)
        else:
            op = _attend_eager(qp, kp, vp, p.mask, scale, softcap)
        op = op.view(nb, kvh, group, n, dim).permute(0, 3, 1, 2, 4).reshape(nb * n, num_heads, dim)
        out.index_copy_(0, p.tokens, op)
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
