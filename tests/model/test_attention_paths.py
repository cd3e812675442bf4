"""Every path of paged attention against one dense reference (float64, per query, keys read from the
cache through the block table): first chunks on their own keys, block gathers, the native kernel
(its AVX-512 and portable builds, one and two threads, its bfloat16 work items on AMX tiles and on
AVX512-BF16 pairs), with causal, window and chunk masks, block sizes that do not divide them,
softcap, and ragged batches mixing every kind of sequence. Cache slots no query may read hold NaN,
so a stray read shows."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import native
from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.layers import PACK_BF16, Linear
from kvtier.model.paged import paged_attention, plan_group

# (num_computed, num_scheduled) per sequence: a first chunk (own keys), a decode, a short
# multi-query step (draft verification), a long chunk after a prefix (gather), an idle sequence,
# a short first chunk, a second decode at another length.
RAGGED = [(0, 12), (20, 1), (13, 3), (9, 12), (5, 0), (0, 5), (7, 1)]
KINDS = [LayerKind(), LayerKind(window=5), LayerKind(chunk=6)]
HEADS, KV_HEADS, DIM = 4, 2, 16


def make_case(
    batch: list[tuple[int, int]], bs: int, dtype: torch.dtype, seed: int = 0, dim: int = DIM
):
    """Metadata, q/k/v of the new tokens and a cache holding each prefix (NaN elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in batch]
    ids = torch.randperm(sum(need) + 4, generator=gen)[: sum(need)] + 1  # block 0: null
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n].tolist())
        at += n
    meta = AttentionMetadata.build([c for c, _ in batch], [n for _, n in batch], [tables], bs)
    cache = torch.full((sum(need) + 5, 2, bs, KV_HEADS, dim), float("nan"), dtype=torch.float64)
    cache[0] = 0.0  # the null block is zeros (never written)
    for (computed, _), table in zip(batch, tables, strict=True):
        for p in range(computed):
            cache[table[p // bs], :, p % bs] = torch.randn(2, KV_HEADS, dim, generator=gen)
    num_tokens = sum(n for _, n in batch)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * dim, generator=gen, dtype=torch.float64)
    q, k, v = qkv.to(dtype).split([HEADS * dim, KV_HEADS * dim, KV_HEADS * dim], dim=-1)
    q = q.view(num_tokens, HEADS, dim)  # a strided view, as the model's fused projection gives
    return meta, q, k.reshape(-1, KV_HEADS, dim), v.reshape(-1, KV_HEADS, dim), cache.to(dtype)


def reference(q, cache, meta, kind, scale, softcap):
    """Dense attention per query in float64 over the keys the mask allows, read by table."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, group = meta.block_size, HEADS // KV_HEADS
    table = meta.block_tables[0]
    for i, (end, n) in enumerate(zip(meta.seq_lens, meta.query_lens, strict=True)):
        pos = torch.arange(end)
        blocks = table[i, pos // bs]
        keys = cache[blocks, 0, pos % bs].double()  # [end, KVH, D]
        values = cache[blocks, 1, pos % bs].double()
        for j in range(n):
            t, qp = meta.query_start_loc[i] + j, end - n + j
            allowed = kind.mask(torch.tensor([qp]), pos)[0]
            for h in range(HEADS):
                s = keys[allowed, h // group] @ q[t, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[t, h] = torch.softmax(s, 0) @ values[allowed, h // group]
    return out


def run_paths(batch, bs, kind, dtype, softcap=None, dim=DIM, **plan_args):
    meta, q, k, v, cache = make_case(batch, bs, dtype, dim=dim)
    plan = plan_group(meta, 0, kind, KV_HEADS, HEADS // KV_HEADS, **plan_args)
    out = paged_attention(q, k, v, cache, plan, dim**-0.5, softcap)
    return out, reference(q, cache, meta, kind, dim**-0.5, softcap), plan


needs_native = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}
_kernels = native.kernels()
TILES = _kernels is not None and _kernels.attention_tiles()
needs_tiles = pytest.mark.skipif(not TILES, reason="no AMX tiles granted here")


@pytest.fixture(params=["tiles", "pairs"])
def attention_path(request):
    """The bfloat16 work items of ≤ 16 query rows on AMX tiles (where granted) or on the
    AVX512-BF16 pairs path; float32 and longer items take the same path either way."""
    if request.param == "tiles" and not TILES:
        pytest.skip("no AMX tiles granted here")
    if _kernels is not None:
        _kernels.attention_tiles(request.param == "tiles")
    yield request.param
    if _kernels is not None:
        _kernels.attention_tiles(True)


@pytest.mark.parametrize("kind", KINDS, ids=["causal", "window5", "chunk6"])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("own_keys", [True, False], ids=["own", "gather"])
def test_torch_paths_match_reference_on_a_ragged_batch(kind, bs, dtype, own_keys):
    out, ref, plan = run_paths(RAGGED, bs, kind, dtype, own_keys=own_keys)
    assert plan.native is None
    assert [o.num_seqs for o in plan.owns] == ([1] if own_keys else [])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


@needs_native
@pytest.mark.parametrize("kind", KINDS, ids=["causal", "window5", "chunk6"])
@pytest.mark.parametrize("bs", [4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [16, 64])  # bf16 with head_dim 64: the AVX512-BF16 pairs path
def test_native_kernel_matches_reference_on_a_ragged_batch(kind, bs, dtype, dim, attention_path):
    out, ref, plan = run_paths(RAGGED, bs, kind, dtype, dim=dim, native=True)
    assert plan.native is not None and plan.native.seq_token.numel() == 4  # the short ones
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [16, 64])
def test_native_kernel_softcap(dtype, dim, attention_path):
    out, ref, _ = run_paths(RAGGED, 4, LayerKind(window=5), dtype, 2.0, dim, native=True)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


def test_softcap_on_the_gather_path():
    out, ref, _ = run_paths(RAGGED, 4, LayerKind(), torch.float64, softcap=2.0, own_keys=False)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@needs_native
def test_native_kernel_same_bits_on_two_threads():
    meta, q, k, v, cache = make_case([(40 + 3 * i, 1) for i in range(9)], 4, torch.float32, 3)
    plan = plan_group(meta, 0, LayerKind(window=7), KV_HEADS, HEADS // KV_HEADS, native=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(q, k, v, cache, plan, 0.3, None)
        torch.set_num_threads(2)
        two = paged_attention(q, k, v, cache, plan, 0.3, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_native
@pytest.mark.parametrize("dim", [16, 64, 128])  # bf16 at 64 and 128: the pairs path
def test_native_bf16_output_is_the_float_result_rounded_to_nearest_even(dim, attention_path):
    """Two equal keys per sequence: each query's weights are exactly 1/2, so its output is the
    float32 mean of two bf16 values (exact), rounded once; ties and every low-bit pattern occur
    among 7 heads x 6 sequences x dim outputs."""
    kernels = native.kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    seqs, kv_heads, group, bs = 6, 2, 7, 16
    cache = torch.randn(seqs, 2, bs, kv_heads, dim, generator=gen).bfloat16()
    cache[:, 0, 1] = cache[:, 0, 0]  # key 1 = key 0: equal scores
    q = torch.randn(seqs, kv_heads * group, dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    ones, count = torch.ones(seqs, dtype=torch.int64), torch.arange(seqs)
    index = (count.view(-1, 1).contiguous(), count, ones, count, torch.zeros(seqs).long(), 2 * ones)
    kernels.paged_attention(q, cache, out, index, dim**-0.5, None)
    mean = (cache[:, 1, 0].float() + cache[:, 1, 1].float()) * 0.5  # [seqs, kv_heads, dim]
    expected = mean.repeat_interleave(group, dim=1).bfloat16()
    assert torch.equal(out, expected)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds x86-64 ISAs")
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("isa", ["x86-64", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_portable_kernel_builds_match_reference(dtype, isa, softcap):
    """The kernel built without AVX-512 gives the same attention: the baseline ISA runs the
    portable loops, x86-64-v3 the AVX2 steps (attention_avx2.c), whatever this CPU has. Head
    dim 32: the AVX2 transpose's 8 × 8 blocks four times a key chunk."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    built = native.build(isa)
    assert built is not None, f"the {isa} build failed (its log says why)"
    meta, q, k, v, cache = make_case(RAGGED, 4, dtype, dim=32)
    kind = LayerKind(window=5)  # a query's first key mid-chunk, beside queries with others
    plan = plan_group(meta, 0, kind, KV_HEADS, HEADS // KV_HEADS, native=True)
    paged_attention(q, k, v, cache, plan, 32**-0.5, softcap)  # writes the new keys
    assert plan.native is not None
    out = torch.zeros(q.shape, dtype=dtype)
    built.paged_attention(q, cache, out, plan.native.index(), 32**-0.5, softcap)
    ref = reference(q, cache, meta, kind, 32**-0.5, softcap)
    rows = torch.cat([torch.arange(a, a + n) for a, n in
                      zip(meta.query_start_loc, meta.query_lens) if 0 < n <= 8])  # fmt: skip
    torch.testing.assert_close(out[rows].double(), ref[rows], atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_first_chunks_of_equal_length_share_one_call_without_a_gather(softcap):
    batch = [(0, 12), (0, 12), (3, 12), (0, 12), (0, 9)]
    tables = [[1, 2, 3], [4, 5, 6], [7] * 4, [8] * 3, [9] * 3]
    meta = AttentionMetadata.build([c for c, _ in batch], [n for _, n in batch], [tables], 4)
    plan = plan_group(meta, 0, LayerKind(window=5), KV_HEADS, HEADS // KV_HEADS)
    twelve, nine = plan.owns
    assert (twelve.num_seqs, twelve.num_queries, twelve.token_start) == (3, 12, None)
    assert twelve.tokens.tolist() == [*range(24), *range(36, 48)]  # the third has a prefix
    assert (nine.num_seqs, nine.token_start) == (1, 48)  # a slice of the batch, no index
    assert twelve.mask is not None and twelve.mask.shape == (12, 12)
    (gather,) = plan.gathers
    assert gather.num_seqs == 1
    for kind in KINDS:
        out, ref, _ = run_paths(batch, 4, kind, torch.float64, softcap=softcap)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_gather_reads_whole_blocks_from_the_window_start():
    meta = AttentionMetadata.build([21, 6], [1, 1], [[[9, 8, 7, 6, 5, 4], [3, 2]]], 4)
    (g,) = plan_group(meta, 0, LayerKind(window=5), KV_HEADS, HEADS // KV_HEADS).gathers
    # query 21 reads 17-21: blocks 4 and 5 (ids 5, 4); query 6 reads 2-6: blocks 0, 1 (3, 2)
    assert g.num_blocks == 2 and g.blocks.tolist() == [5, 4, 3, 2]
    # the tail past each end is zeroed: positions 22-23 (rows 6, 7), 7 (row 8 + 7)
    assert g.tail_rows is not None and g.tail_rows.tolist() == [6, 7, 15]


@pytest.mark.skipif(not PACK_BF16, reason="oneDNN without bf16 here")
def test_prepacked_linear_gives_the_bits_of_f_linear_and_follows_its_weight():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.weight = torch.nn.Parameter(torch.randn(96, 64, generator=gen).to(torch.bfloat16))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer.float()(x.float()), F.linear(x.float(), layer.weight, layer.bias))


def _group_case(specs, bs, dim, kv_heads=2, group=7, seed=0):
    """Sequences at the 0.5B shape's grouping (7 query heads a KV head), each (keys, queries,
    window): its keys in random blocks (NaN in every slot past them), its queries the last
    `queries` positions, each reading [hi - window, hi) or [0, hi). Returns q, cache, index."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-keys // bs) for keys, _, _ in specs]
    ids = torch.randperm(sum(need) + 3, generator=gen)[: sum(need)] + 1
    cache = torch.full((sum(need) + 4, 2, bs, kv_heads, dim), float("nan"))
    tables = torch.zeros(len(specs), max(need), dtype=torch.int64)
    lo, hi, qlen, at = [], [], [], 0
    for i, ((keys, queries, window), n) in enumerate(zip(specs, need, strict=True)):
        tables[i, :n] = ids[at : at + n]
        at += n
        for p in range(keys):
            cache[tables[i, p // bs], :, p % bs] = torch.randn(2, kv_heads, dim, generator=gen)
        for j in range(queries):
            end = keys - queries + j + 1
            lo.append(max(0, end - window) if window else 0)
            hi.append(end)
        qlen.append(queries)
    start = torch.tensor([0, *qlen[:-1]]).cumsum(0)
    q = torch.randn(len(lo), kv_heads * group, dim, generator=gen).bfloat16()
    index = (tables, start, torch.tensor(qlen), start.clone(), torch.tensor(lo), torch.tensor(hi))
    return q, cache.bfloat16(), index


def _group_reference(q, cache, index, scale):
    tables, start, qlen, _, lo, hi = index
    bs, group = cache.shape[2], q.shape[1] // cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(tables.shape[0]):
        for t in range(int(start[i]), int(start[i] + qlen[i])):
            pos = torch.arange(int(lo[t]), int(hi[t]))
            blocks = tables[i, pos // bs]
            keys = cache[blocks, 0, pos % bs].double()  # [n, KVH, D]
            values = cache[blocks, 1, pos % bs].double()
            for h in range(q.shape[1]):
                s = keys[:, h // group] @ q[t, h].double() * scale
                out[t, h] = torch.softmax(s, 0) @ values[:, h // group]
    return out


# One key; within one chunk; exactly one; a two-query draft (14 rows: one tile); past one
# segment of 256 keys with an odd number of chunks after it, whose missing partner chunk must
# weigh nothing (257, 300); a window starting mid-block.
GROUP_SPECS = [(1, 1, None), (9, 1, None), (16, 1, None), (17, 2, None), (257, 1, None),
               (300, 2, None), (513, 1, 100)]  # fmt: skip


@needs_native
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bs", [4, 16])
def test_native_bf16_matches_reference_at_seven_query_heads_a_kv_head(dim, bs, attention_path):
    q, cache, index = _group_case(GROUP_SPECS, bs, dim)
    out = torch.empty_like(q)
    native.kernels().paged_attention(q, cache, out, index, dim**-0.5, None)
    ref = _group_reference(q, cache, index, dim**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.bfloat16], rtol=0)


def _call_and_report(conn, q, cache, index, want):
    out = torch.empty_like(q)
    native.kernels().paged_attention(q, cache, out, index, 0.125, None)
    conn.send(bool((out.double() - want).abs().max() <= TOL[torch.bfloat16]))


@needs_tiles
def test_tiles_never_read_past_a_block_that_ends_the_cache():
    """A tile loads 16 key rows; a block of 4 ends after 4, so its chunk is copied first. Here
    the cache's last block ends where a page the process may not read begins: a tile loaded
    in place would read 2 KB into it and the call would fault (run in a forked child)."""
    page = mmap.PAGESIZE
    q, small, index = _group_case([(4, 1, None)], 4, 64)
    small[-1] = small[int(index[0][0, 0])].clone()  # the cache's last block holds the keys
    index[0][0, 0] = small.shape[0] - 1
    nbytes = small.numel() * small.element_size()
    region = mmap.mmap(-1, (-(-nbytes // page) + 1) * page)
    end = len(region) - page  # the guard page starts here
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + end, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
    cache = torch.frombuffer(region, dtype=torch.bfloat16, count=small.numel(),
                             offset=end - nbytes).view(small.shape)  # fmt: skip
    cache.copy_(small)
    want = _group_reference(q, cache, index, 0.125)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_call_and_report, args=(child_end, q, cache, index, want))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the kernel call died (exit {child.exitcode})"
    assert parent_end.poll(1) and parent_end.recv(), "wrong attention"
