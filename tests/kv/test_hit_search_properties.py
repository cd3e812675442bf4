"""Every manager's cache-hit search returns the longest valid hit, checked against brute force.

Valid hit of L blocks (L·bs a multiple of the alignment, within max_length and the hashed blocks):
full — blocks [0, L) cached; window W — blocks [L − cdiv(W−1, bs), L) cached; chunked C — blocks
from L's chunk start to L cached; mamba — block L−1 (the snapshot at L·bs) cached. The coordinator
must return the longest L valid for every group at once.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.kv import BlockPool, ChunkedLocal, FullAttention, Mamba, SlidingWindow
from kvtier.kv.coordinator import KVCacheCoordinator
from kvtier.kv.single_type import make_manager
from kvtier.kv.specs import KVSpec, cdiv


def valid(spec: KVSpec, cached: list[bool], length: int) -> bool:
    bs = spec.block_size
    if isinstance(spec, FullAttention):
        return all(cached[:length])
    if isinstance(spec, SlidingWindow):
        return all(cached[max(0, length - cdiv(spec.window - 1, bs)) : length])
    if isinstance(spec, ChunkedLocal):
        return all(cached[length * bs // spec.chunk * spec.chunk // bs : length])
    assert isinstance(spec, Mamba)
    return cached[length - 1]


def brute_force(spec: KVSpec, cached: list[bool], max_length: int, alignment: int) -> int:
    bs = spec.block_size
    best = 0
    for length in range(1, min(max_length // bs, len(cached)) + 1):
        if (length * bs) % alignment == 0 and valid(spec, cached, length):
            best = length
    return best


@st.composite
def single_group(draw: st.DrawFn) -> tuple[KVSpec, list[bool], int, int]:
    bs = draw(st.sampled_from([1, 2, 4]))
    alignment = bs * draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(["full", "window", "chunk", "mamba"]))
    spec: KVSpec
    if kind == "full":
        spec = FullAttention(bs)
    elif kind == "window":
        spec = SlidingWindow(bs, draw(st.integers(1, 14)))
    elif kind == "chunk":
        spec = ChunkedLocal(bs, alignment * draw(st.integers(1, 4)))
    else:
        spec = Mamba(bs)
    cached = draw(st.lists(st.booleans(), max_size=14))
    max_length = draw(st.integers(0, len(cached) * bs + 3))
    return spec, cached, max_length, alignment


def cached_pool(specs: list[KVSpec], patterns: list[list[bool]]) -> tuple[BlockPool, list[bytes]]:
    pool = BlockPool(200)
    n = len(patterns[0])
    hashes = [i.to_bytes(2, "big") for i in range(n)]
    for gid, (spec, pattern) in enumerate(zip(specs, patterns)):
        blocks = pool.get_new_blocks(n)
        for i, hit in enumerate(pattern):
            if hit:
                pool.cache_full_blocks(gid, blocks, hashes, i, i + 1, spec.block_size)
    return pool, hashes


@given(single_group())
def test_each_manager_finds_the_longest_valid_hit(
    case: tuple[KVSpec, list[bool], int, int],
) -> None:
    spec, cached, max_length, alignment = case
    pool, hashes = cached_pool([spec], [cached])
    mgr = make_manager(spec, pool, 0)
    got = mgr.find_longest_cache_hit(hashes, max_length, alignment)
    best = brute_force(spec, cached, max_length, alignment)
    assert len(got) == best
    for i, block in enumerate(got):  # real blocks exactly where the hit needs them
        needed = not valid(spec, [j != i for j in range(best)], best)
        assert block.is_null == (not needed), (i, block)


@st.composite
def hybrid(draw: st.DrawFn) -> tuple[list[KVSpec], list[list[bool]], int]:
    bs = 2
    specs: list[KVSpec] = [FullAttention(bs)]
    specs += draw(
        st.lists(
            st.one_of(
                st.builds(SlidingWindow, st.just(bs), st.integers(1, 9)),
                st.builds(ChunkedLocal, st.just(bs), st.sampled_from([2, 4, 6])),
                st.just(Mamba(bs)),
            ),
            min_size=1,
            max_size=3,
        )
    )
    n = draw(st.integers(0, 12))
    patterns = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in specs]
    max_length = draw(st.integers(0, n * bs))
    return specs, patterns, max_length


@given(hybrid())
def test_coordinator_returns_longest_hit_every_group_serves(
    case: tuple[list[KVSpec], list[list[bool]], int],
) -> None:
    specs, patterns, max_length = case
    pool, hashes = cached_pool(specs, patterns)
    coord = KVCacheCoordinator(specs, pool)
    hits, length = coord.find_longest_cache_hit(hashes, max_length)
    best = 0
    for n in range(1, min(max_length // 2, len(hashes)) + 1):
        if all(valid(s, p, n) for s, p in zip(specs, patterns)):
            best = n
    assert length == best * 2
    assert all(len(h) == best for h in hits)
