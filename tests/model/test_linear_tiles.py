"""The tile linear kernel (kernels/csrc/linear*.c, AMX, AVX512-BF16, or widened on AVX2 or AVX-512)
gives the bits of bfloat16 products summed over k in order in float32 and rounded once — on AMX
what oneDNN gives a row in a batch of up to 32 rows; elsewhere exactly VDPBF16PS's sums (each pair's odd product
added, then its even one), which are oneDNN's wherever oneDNN sums in order (k ≤ 512) — with partial k blocks and
output tiles, bias or none, strided rows, and any number of threads; `Linear` picks it for few
rows and oneDNN above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import native
from kvtier.model.layers import Linear, takes_tiles

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.tile_linear, reason="no tile linear here"
)
KIND = "" if kernels is None else (kernels.tile_linear or "")

# (k, n): whole tiles, a partial last k block (k % 32), a partial last output tile (n % 16), a
# single output column, and the small models' shapes
SHAPES = [(64, 96), (100, 77), (33, 1), (256, 1376), (688, 256), (128, 4096), (896, 1152)]


def batches_of_32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x's rows in batches of up to 32 (above, oneDNN changes its order for k ≥ 512:
    see `takes_tiles`)."""
    return torch.cat([F.linear(x[i : i + 32], w, b) for i in range(0, x.shape[0], 32)])


def in_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """VDPBF16PS's sums written out: per k pair, the odd product added to the float32 sum, then
    the even one (products of two bfloat16 are exact in float32); the bias added to the sum; one
    rounding to bfloat16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(0, x.shape[1], 2):
        if p + 1 < x.shape[1]:
            acc = acc + xf[:, p + 1, None] * wf[None, :, p + 1]
        acc = acc + xf[:, p, None] * wf[None, :, p]
    return (acc if b is None else acc + b.float()).bfloat16()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return batches_of_32(x, w, b) if KIND == "amx" else in_order(x, w, b)


def assert_reference_bits(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor
) -> None:
    """The tiles give `reference`'s bits on one thread and on two."""
    assert kernels is not None
    want = reference(x, w, b)
    for threads in (1, 2):
        native.set_threads(threads)
        try:
            got = kernels.linear_bf16(x, packed, w.shape[0], b)
        finally:
            native.set_threads(None)
        assert torch.equal(got, want), (x.shape[0], threads)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_same_bits_as_f_linear(k: int, n: int, bias: bool) -> None:
    assert kernels is not None
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = kernels.pack_linear(w)
    for m in (1, 2, 7, 8, 9, 15, 16, 17, 32, 40, 64, 100, 256):  # 7-16: blocks of 3 tiles
        x = torch.randn(m, k, generator=gen).bfloat16()
        assert_reference_bits(x, w, b, packed)


def test_strided_rows() -> None:
    """Rows read `x.stride(0)` apart (a view of a wider tensor), the partial k block too."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 150, generator=gen).bfloat16()
    x = wide[:, 10:110]  # k = 100: three whole blocks and a partial one
    w = torch.randn(48, 100, generator=gen).bfloat16()
    got = kernels.linear_bf16(x, kernels.pack_linear(w), 48, None)
    assert torch.equal(got, F.linear(x.contiguous(), w))


@pytest.mark.skipif(KIND != "avx512bf16", reason="oneDNN's order on AVX512-BF16")
def test_avx512bf16_gives_onednn_bits_where_onednn_sums_in_order() -> None:
    """At k ≤ 512 (the small models' linears) oneDNN sums k in order too: the same bits."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    for k, n in [(64, 256), (256, 1536), (512, 256), (33, 96)]:
        w = torch.randn(n, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16()
        packed = kernels.pack_linear(w)
        for m in (1, 7, 64, 256):
            x = torch.randn(m, k, generator=gen).bfloat16()
            assert torch.equal(kernels.linear_bf16(x, packed, n, b), F.linear(x, w, b)), (k, n, m)


@pytest.mark.parametrize("k,n,m", [(128, 1024, 2100), (100, 77, 2700), (512, 256, 600)])
def test_many_rows_run_in_chunks(k: int, n: int, m: int) -> None:
    """Past 256 KiB of x on a weight of at most 1 MiB the rows run in chunks (linear.c's items):
    every chunk's rows, the last partial chunk and its partial row block, get `reference`'s bits."""
    assert kernels is not None and m * k * 2 > 256 << 10
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    assert_reference_bits(x, w, b, kernels.pack_linear(w))


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """Unlike oneDNN above 32 rows, the tiles compute a row the same way whatever its batch."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(300, 896, generator=gen).bfloat16()
    x = torch.randn(64, 896, generator=gen).bfloat16()
    packed = kernels.pack_linear(w)
    whole = kernels.linear_bf16(x, packed, 300, None)
    for i in (0, 17, 63):
        assert torch.equal(kernels.linear_bf16(x[i : i + 1], packed, 300, None)[0], whole[i])


def test_linear_takes_the_tiles_for_few_rows_and_onednn_above() -> None:
    """The choice (`takes_tiles`: up to 64 rows on any weight, any row count on weights of at
    most 2M elements), and `Linear` gives the tiles' bits where it takes them and F.linear's
    elsewhere."""
    assert takes_tiles(64, 2048 * 1100) and not takes_tiles(65, 2048 * 1100)
    assert takes_tiles(65, 2 << 20) and not takes_tiles(65, (2 << 20) + 1)
    assert takes_tiles(10_000, 256 * 512)
    # oneDNN's bfloat16 is emulated where the tiles widen to float32
    assert takes_tiles(10_000, 2048 * 1100, "avx2") and takes_tiles(10_000, 2048 * 1100, "avx512")
    gen = torch.Generator().manual_seed(2)
    small = Linear(256, 512, bias=True).to(torch.bfloat16)
    down = Linear(1024, 256, bias=False).to(torch.bfloat16)
    big = Linear(2048, 1100, bias=False).to(torch.bfloat16)
    for layer, rows in [(small, 1), (small, 256), (small, 257), (down, 48), (down, 130),
                        (big, 17), (big, 64), (big, 65)]:  # fmt: skip
        x = torch.randn(rows, layer.in_features, generator=gen).bfloat16()
        tiles = takes_tiles(rows, layer.weight.numel(), KIND)
        want = reference if tiles else F.linear
        assert torch.equal(layer(x), want(x, layer.weight, layer.bias)), rows


f32 = pytest.mark.skipif(
    kernels is None or not kernels.f32_linear, reason="no AVX-512F or AVX2 here"
)


@f32
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_f32_rows_get_the_same_bits_in_any_batch(k: int, n: int, bias: bool) -> None:
    """The float32 kernel: a row's result is the same bits alone or in any batch, on any number
    of threads, and float32-close to the exact product (float64)."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(k * 7 + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(64, k, generator=gen)
    packed = kernels.pack_linear(w)
    whole = kernels.linear_f32(x, packed, n, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1.0)
    assert ((whole.double() - exact).abs() / scale).max() < 1e-6
    for m in (1, 2, 3, 7, 8, 17):
        for threads in (1, 2):
            native.set_threads(threads)
            try:
                got = kernels.linear_f32(x[:m], packed, n, b)
            finally:
                native.set_threads(None)
            assert torch.equal(got, whole[:m]), (m, threads)


@f32
def test_f32_linear_rows_do_not_depend_on_the_batch_and_strided_rows() -> None:
    """`Linear` in float32: a row's output is the same alone as in a batch (oneDNN's and MKL's
    float32 GEMMs are not, on some CPUs: then a seeded sample depended on its batch —
    tests/server/test_endpoints.py, n children); rows `x.stride(0)` apart too."""
    gen = torch.Generator().manual_seed(5)
    layer = Linear(256, 1536, bias=True)
    x = torch.randn(40, 256, generator=gen)
    with torch.no_grad():
        whole = layer(x)
        for m in (1, 3, 8, 25):
            assert torch.equal(layer(x[:m]), whole[:m]), m
        wide = torch.randn(9, 300, generator=gen)
        assert torch.equal(layer(wide[:, 20:276]), layer(wide[:, 20:276].contiguous()))


# the builds whose tile linear widens to float32 FMAs, and its kind there
WIDENED_BUILDS = {"x86-64-v3": "avx2", "skylake-avx512": "avx512", "cascadelake": "avx512"}


@pytest.mark.parametrize("isa", WIDENED_BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 12, 37, 70])
@pytest.mark.parametrize(("k", "n"), [(100, 77), (896, 1152)])
def test_the_widened_builds_give_the_in_order_bits(
    isa_build, isa: str, rows: int, k: int, n: int
) -> None:
    """The widened paths whatever this CPU builds natively — AVX2 (linear_avx2.c, the x86-64-v3
    build) and AVX-512 without BF16 (linear_wide_avx512.c, Skylake-SP and Cascade Lake builds):
    VDPBF16PS's sums by FMA, each row block and column group, with and without a bias, rows
    read `x.stride(0)` apart (x is widened once per call), on one thread and on two."""
    built = isa_build(isa)
    assert built.tile_linear == WIDENED_BUILDS[isa]
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k + 9, generator=gen).bfloat16()[:, 5 : 5 + k]
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = built.pack_linear(w)
    for threads in (1, 2):
        native.set_threads(threads)
        try:
            for bias in (None, b):
                got = built.linear_bf16(x, packed, n, bias)
                assert torch.equal(got, in_order(x, w, bias)), (threads, bias is None)
        finally:
            native.set_threads(None)
