"""The paged attention op: per-KV-group plans (built once per forward on the host, shared by the
group's layers) and the layer step — write the new K/V by slot mapping, then attend: first chunks
of a prompt (no cached prefix) on their own new keys; sequences with few queries (decodes, drafts)
with the native kernel straight from the cache where it serves (`native.py`: CPU, float32 or
bfloat16 queries, the cache theirs or fp8), else, like longer chunks after a prefix, on keys
gathered from the cache block by block; causal/window/chunk masks throughout. An fp8 cache holds
codes of K/V over per-tensor scales (`stored`; docs/kernels.md, "8-bit KV"). Holds no state
between forwards.

A KV tensor is [num_blocks, 2, block_size, num_kv_heads, head_dim] (`device.types.KVLayout`), so
the keys of one block are one contiguous [block_size, kv_heads, head_dim] chunk: a gather copies a
few whole blocks per sequence (not a row per token and head) into [n, width, kv_heads, head_dim],
which SDPA reads as strided [n, kv_heads, width, head_dim] without a further copy. Grouped query
heads are folded into the query rows ([n, kv_heads, group * queries, head_dim]) so one call serves
a whole batch. Keys past a sequence's end in its last block may hold anything (stale data, NaN
poison): they are masked and zeroed after the gather, so no NaN reaches the softmax or the sum.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvtier.model import native
from kvtier.model.attention import AttentionMetadata, LayerKind

MAX_BATCHED_QUERY = 8  # sequences with at most this many queries share one padded gather call
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # 8-bit KV dtypes: largest finite


def stored(x: torch.Tensor, cache_dtype: torch.dtype, x_scale: float = 1.0) -> torch.Tensor:
    """What a cache of `cache_dtype` holds for K or V `x`: x itself cast, or for an 8-bit cache
    x / x_scale in float32, saturated to the format's largest finite value and rounded to nearest
    even (vLLM's fp8 KV; the native layer kernel rounds to the same bits)."""
    if cache_dtype not in FP8:
        return x.to(cache_dtype)
    top = FP8[cache_dtype]
    y = x.float() if x_scale == 1.0 else x.float() / x_scale
    return y.clamp(-top, top).to(cache_dtype)


@dataclass(frozen=True)
class GatherPlan:
    """Sequences attended over keys gathered by block: each padded to `num_queries` queries and
    `num_blocks` blocks (the null block pads; its keys are masked)."""

    num_seqs: int
    num_queries: int  # Q
    num_blocks: int  # per sequence; width = num_blocks * block_size keys
    in_order: bool  # Q == 1 and these are all the tokens, in order: no query gather/scatter
    query_tokens: torch.Tensor  # [n * Q] token of each padded query (padding repeats the last)
    out_rows: torch.Tensor  # [num_real] rows of the padded output that are real queries
    out_tokens: torch.Tensor  # [num_real] their token indices
    blocks: torch.Tensor  # [n * num_blocks] block ids, from the block of each first key
    tail_rows: torch.Tensor | None  # [m] rows of the gathered [n * width] past each sequence end
    mask: torch.Tensor  # [n, 1, G * Q, width] bool, query rows ordered (g, q)


@dataclass(frozen=True)
class OwnPlan:
    """First chunks of equal length with no cached prefix: they attend to their own new keys."""

    num_seqs: int
    num_queries: int  # q per sequence
    token_start: int | None  # the chunks are tokens [start, start + n * q), or None: `tokens`
    tokens: torch.Tensor  # [n * q] token indices, sequence-major
    mask: torch.Tensor | None  # [q, q] bool (window or chunk layers); None: causal


@dataclass(frozen=True)
class NativePlan:
    """Sequences with few queries for the native kernel: every query reads its key range from
    the cache through its sequence's block table (see `kernels/csrc/attention.c`)."""

    tables: torch.Tensor  # [n, max_blocks] int64 block ids
    seq_token: torch.Tensor  # [n] token index of each sequence's first query
    seq_qlen: torch.Tensor  # [n] its queries
    seq_row: torch.Tensor  # [n] index of its first query in lo / hi
    lo: torch.Tensor  # [rows] first key position each query reads
    hi: torch.Tensor  # [rows] one past its last (its own position + 1)

    def index(self) -> tuple[torch.Tensor, ...]:
        return (self.tables, self.seq_token, self.seq_qlen, self.seq_row, self.lo, self.hi)


@dataclass(frozen=True)
class GroupPlan:
    """Index tensors of one KV group for one forward; shared by every layer of the group."""

    block_size: int
    num_tokens: int
    write_tokens: torch.Tensor | None  # [num_written] token indices; None = every token
    write_rows: torch.Tensor  # [num_written] token rows of the keys to write
    native: NativePlan | None
    gathers: list[GatherPlan]
    owns: list[OwnPlan]

    def to(self, device: torch.device) -> GroupPlan:
        """The plan with its index tensors on `device` (plans are built on the host)."""
        if device == torch.device("cpu"):
            return self
        moved: GroupPlan = _moved(self, device)
        return moved


def _moved(obj: Any, device: torch.device) -> Any:
    values: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
        elif isinstance(value, list):
            value = [_moved(v, device) for v in value]
        elif is_dataclass(value):
            value = _moved(value, device)
        values[f.name] = value
    return type(obj)(**values)


def plan_group(
    meta: AttentionMetadata,
    group: int,
    kind: LayerKind,
    num_kv_heads: int,
    num_queries_per_kv: int,
    *,
    own_keys: bool = True,
    native: bool = False,
    native_chunks: bool = False,
) -> GroupPlan:
    """Precompute the writes and reads of KV group `group` for this forward (on the host).

    `own_keys=False` sends first chunks through the gather path too (tests comparing the
    paths); `native=True` gives sequences with few queries to the native kernel (the caller
    checks `native.usable`), and with `native_chunks` longer chunks too (the kernel splits
    them in blocks of queries; the caller sets it where the step runs as one call per layer,
    which needs every query on the kernel — elsewhere SDPA is faster on a long chunk)."""
    bs = meta.block_size
    table = meta.block_tables[group].cpu()
    slots = meta.slot_mappings[group].cpu().numpy()  # numpy: as in `_plan_native`
    write_tokens = None
    written = slots >= 0
    if not written.all():
        write_tokens = torch.from_numpy(np.flatnonzero(written))
        slots = slots[written]
    write_rows = torch.from_numpy(slots + slots // bs * bs)
    qlens, seq_lens = meta.query_lens, meta.seq_lens
    short: list[int] = []
    gathered: dict[int, list[int]] = {}  # query count → sequences
    owned: dict[int, list[int]] = {}
    for i, q in enumerate(qlens):
        if q == 0:
            continue
        if q <= MAX_BATCHED_QUERY or (native and native_chunks):
            short.append(i)
        elif own_keys and seq_lens[i] == q:
            owned.setdefault(q, []).append(i)
        else:
            gathered.setdefault(q, []).append(i)
    native_plan = _plan_native(meta, short, table, kind) if short and native else None
    if native_plan is not None:
        short = []
    gathers = [_plan_gather(meta, seqs, table, kind, num_queries_per_kv) for seqs in
               ([short] if short else []) + list(gathered.values())]  # fmt: skip
    owns = [_plan_own(meta, seqs, q, kind) for q, seqs in owned.items()]
    num_tokens = meta.query_start_loc[-1]
    return GroupPlan(bs, num_tokens, write_tokens, write_rows, native_plan, gathers, owns)


def _plan_native(
    meta: AttentionMetadata, seqs: list[int], table: torch.Tensor, kind: LayerKind
) -> NativePlan:
    # numpy, not torch: a dozen small ops per group and step, where torch's per-op dispatch
    # would cost more than the work itself
    qlens, lens, loc = meta.query_lens, meta.seq_lens, meta.query_start_loc
    counts = np.array([qlens[i] for i in seqs], dtype=np.int64)  # [n]
    seq_row = np.cumsum(counts) - counts
    seq = np.repeat(np.arange(len(seqs)), counts)  # [rows]
    ends = np.array([lens[i] for i in seqs], dtype=np.int64)
    q_pos = ends[seq] - counts[seq] + np.arange(len(seq)) - seq_row[seq]
    seq_table = table if len(seqs) == len(lens) else table[torch.tensor(seqs)]
    return NativePlan(
        tables=seq_table.contiguous(),
        seq_token=torch.from_numpy(np.array([loc[i] for i in seqs], dtype=np.int64)),
        seq_qlen=torch.from_numpy(counts),
        seq_row=torch.from_numpy(seq_row),
        lo=torch.from_numpy(kind.first_key(q_pos)),
        hi=torch.from_numpy(q_pos + 1),
    )


def _plan_gather(
    meta: AttentionMetadata, seqs: list[int], table: torch.Tensor, kind: LayerKind, group: int
) -> GatherPlan:
    bs = meta.block_size
    qlens = torch.tensor([meta.query_lens[i] for i in seqs])  # [n]
    lens = torch.tensor([meta.seq_lens[i] for i in seqs])
    firsts = [meta.seq_lens[i] - meta.query_lens[i] for i in seqs]
    first_block = torch.tensor([kind.kv_start(f) // bs for f in firsts])  # [n]
    end_block = (lens + bs - 1) // bs  # one past each sequence's last block
    num_q, num_blocks = int(qlens.max()), int((end_block - first_block).max())
    width = num_blocks * bs
    j = torch.arange(num_q)[None, :]
    q_off = torch.minimum(j, qlens[:, None] - 1)  # [n, Q]
    q_pos = lens[:, None] - qlens[:, None] + q_off
    query_tokens = torch.tensor([meta.query_start_loc[i] for i in seqs])[:, None] + q_off
    real = (j < qlens[:, None]).flatten()
    b = first_block[:, None] + torch.arange(num_blocks)[None, :]  # [n, num_blocks] positions
    seq_table = table if len(seqs) == len(meta.seq_lens) else table[torch.tensor(seqs)]
    in_table = b < end_block[:, None]
    blocks = seq_table.gather(1, b.clamp(max=seq_table.shape[1] - 1)) * in_table  # 0 pads
    k_pos = first_block[:, None] * bs + torch.arange(width)[None, :]  # [n, width]
    mask = kind.allowed(q_pos[:, :, None], k_pos[:, None, :])  # [n, Q, width]; causal: k < len
    mask = mask[:, None] if num_q == 1 else mask.repeat(1, group, 1)[:, None]
    tail = end_block * bs - lens  # keys past the end in each last block
    tail_rows = None
    if int(tail.sum()):
        seq = torch.repeat_interleave(torch.arange(len(seqs)), tail)
        starts = torch.cumsum(tail, 0) - tail
        offset = torch.arange(int(tail.sum())) - starts[seq]
        tail_rows = seq * width + (lens - first_block * bs)[seq] + offset
    return GatherPlan(
        num_seqs=len(seqs),
        num_queries=num_q,
        num_blocks=num_blocks,
        in_order=num_q == 1 and len(seqs) == len(meta.seq_lens),
        query_tokens=query_tokens.flatten(),
        out_rows=torch.nonzero(real).flatten(),
        out_tokens=query_tokens.flatten()[real],
        blocks=blocks.flatten(),
        tail_rows=tail_rows,
        mask=mask,
    )


def _plan_own(meta: AttentionMetadata, seqs: list[int], q: int, kind: LayerKind) -> OwnPlan:
    loc = meta.query_start_loc
    contiguous = all(loc[b] == loc[a] + q for a, b in itertools.pairwise(seqs))
    tokens = torch.cat([torch.arange(loc[i], loc[i] + q) for i in seqs])
    pos = torch.arange(q)
    mask = None if kind.window is None and kind.chunk is None else kind.mask(pos, pos)
    return OwnPlan(len(seqs), q, loc[seqs[0]] if contiguous else None, tokens, mask)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: GroupPlan,
    scale: float,
    softcap: float | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] → [T, H, D]; writes k/v into `kv_cache` first (an 8-bit
    cache holds k / k_scale and v / v_scale, `stored`)."""
    num_tokens, num_heads, dim = q.shape
    kvh = k.shape[1]
    bs = plan.block_size
    if kv_cache.dtype not in FP8:  # scales are an 8-bit cache's; a float cache holds K/V as is
        k_scale = v_scale = 1.0
    flat = kv_cache.view(-1, kvh * dim)  # token rows [num_blocks * 2 * block_size, KVH * D]
    kw, vw = k, v
    if plan.write_tokens is not None:
        kw, vw = k[plan.write_tokens], v[plan.write_tokens]
    rows = flat.view(torch.uint8) if flat.dtype in FP8 else flat  # no fp8 index_copy_ on CPU
    for x, at, x_scale in ((kw, plan.write_rows, k_scale), (vw, plan.write_rows + bs, v_scale)):
        rows.index_copy_(
            0, at, stored(x.reshape(-1, kvh * dim), flat.dtype, x_scale).view(rows.dtype)
        )
    out = None
    if plan.native is not None:
        out = q.new_empty(num_tokens, num_heads, dim)
        kernels = native.kernels()
        assert kernels is not None, "plan_group(native=True) needs the native kernels"
        kernels.paged_attention(
            q, kv_cache, out, plan.native.index(), scale, softcap, k_scale, v_scale
        )
    pieces: list[tuple[torch.Tensor, torch.Tensor | int]] = []  # rows; their tokens or first
    # 8-bit caches: the k scale folds into the score scale, the v scale into the output (exact:
    # every fp8 code is a bfloat16/float16 value), as the native kernel does
    kscale = scale * k_scale
    for g in plan.gathers:
        ob = _attend_gathered(q, kv_cache, g, kscale, softcap)  # [n * Q, H, D]
        pieces.append((ob, 0) if g.in_order else (ob.index_select(0, g.out_rows), g.out_tokens))
    for o in plan.owns:
        own = _attend_own(q, k, v, kv_cache.dtype, o, scale, softcap, k_scale, v_scale)
        pieces.append((own, o.tokens if o.token_start is None else o.token_start))
    if v_scale != 1.0:
        pieces = [(p * v_scale, where) for p, where in pieces]
    if out is None and len(pieces) == 1 and pieces[0][0].shape[0] == num_tokens:
        rows_out, where = pieces[0]
        if isinstance(where, int) and where == 0:
            return rows_out
    if out is None:
        out = q.new_empty(num_tokens, num_heads, dim)
    for piece, where in pieces:
        if isinstance(where, int):
            out[where : where + piece.shape[0]] = piece
        else:
            out.index_copy_(0, where, piece)
    return out


def _attend_gathered(
    q: torch.Tensor, kv_cache: torch.Tensor, g: GatherPlan, scale: float, softcap: float | None
) -> torch.Tensor:
    """The plan's queries over its gathered blocks → [n * Q, H, D] (padded query rows)."""
    _, num_heads, dim = q.shape
    kvh = kv_cache.shape[3]
    group = num_heads // kvh
    n, nq, width = g.num_seqs, g.num_queries, g.mask.shape[-1]
    qb = q if g.in_order else q.index_select(0, g.query_tokens)  # [n * Q, H, D]
    if nq == 1:
        qb = qb.view(n, kvh, group, dim)
    else:
        qb = qb.view(n, nq, kvh, group, dim).permute(0, 2, 3, 1, 4).reshape(n, kvh, -1, dim)
    keys, values = (kv_cache[:, i].index_select(0, g.blocks) for i in (0, 1))  # [n*nb, bs, ..]
    if g.tail_rows is not None:  # whatever lies past a sequence's end must not be NaN
        for t in (keys, values):  # through bytes: no fp8 index_fill_ on CPU; 0 is 0.0 in each
            rows = t.view(-1, kvh * dim)
            (rows.view(torch.uint8) if t.dtype in FP8 else rows).index_fill_(0, g.tail_rows, 0)
    kb = keys.view(n, width, kvh, dim).transpose(1, 2).to(q.dtype)  # [n, KVH, width, D]
    vb = values.view(n, width, kvh, dim).transpose(1, 2).to(q.dtype)
    if softcap is None:
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, scale=scale)
    else:
        ob = _attend_eager(qb, kb, vb, g.mask, scale, softcap)  # [n, KVH, G * Q, D]
    if nq == 1:
        return ob.reshape(n, num_heads, dim)
    return ob.view(n, kvh, group, nq, dim).permute(0, 3, 1, 2, 4).reshape(n * nq, num_heads, dim)


def _attend_own(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_dtype: torch.dtype,
    o: OwnPlan,
    scale: float,
    softcap: float | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """First chunks over their own keys → [n * q, H, D], causal (or the plan's mask); an 8-bit
    cache's scales as `paged_attention` applies them (the caller scales the output by v's)."""
    _, num_heads, dim = q.shape
    kvh = k.shape[1]
    n, nq = o.num_seqs, o.num_queries
    if o.token_start is not None:
        a, b = o.token_start, o.token_start + n * nq
        qs, ks, vs = q[a:b], k[a:b], v[a:b]
    else:
        qs, ks, vs = (t.index_select(0, o.tokens) for t in (q, k, v))
    if cache_dtype != q.dtype:  # read what the cache holds, as a gather would
        ks = stored(ks, cache_dtype, k_scale).to(q.dtype)
        vs = stored(vs, cache_dtype, v_scale).to(q.dtype)
        scale *= k_scale
    qs = qs.view(n, nq, num_heads, dim).transpose(1, 2)  # [n, H, q, D]
    ks = ks.view(n, nq, kvh, dim).transpose(1, 2)  # [n, KVH, q, D]
    vs = vs.view(n, nq, kvh, dim).transpose(1, 2)
    if softcap is None:
        os = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=o.mask, is_causal=o.mask is None, scale=scale, enable_gqa=True
        )  # [n, H, q, D]
    else:  # one KV head per query head, and the mask (causal when the plan has none)
        group = num_heads // kvh
        mask = o.mask if o.mask is not None else torch.ones(nq, nq, dtype=torch.bool).tril()
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        os = _attend_eager(qs, ks, vs, mask.to(q.device), scale, softcap)
    return os.transpose(1, 2).reshape(n * nq, num_heads, dim)


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
