"""The structured outputs' token mask (model/grammar.py `apply_mask`): the native kernel
(kernels/csrc/mask.c) gives the bits of the torch path that unpacks llguidance's bitmask, on
both logits dtypes, any vocabulary, a subset of rows, words of all ones and all zeros, masks
narrower and wider than the vocabulary (docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import native
from kvtier.model.grammar import _unpack_and_mask, apply_mask

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _case(
    num_rows: int, vocab: int, words: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits (a NaN and infinities among them) and a random mask in which some words
    allow everything and some nothing."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g).to(dtype)
    logits[0, 5], logits[-1, -1], logits[1 % num_rows, 7] = float("nan"), float("inf"), -1e30
    mask = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=g)
    pick = torch.rand(num_rows, words, generator=g)
    mask[pick < 0.2] = -1
    mask[pick > 0.8] = 0
    return logits, mask


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(BITS[x.dtype])


def _expected(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The mask's meaning spelled out on Python ints, independent of both paths."""
    out = logits.clone()
    words = mask.shape[1]
    for r in rows:
        m = [w & 0xFFFFFFFF for w in mask[r].tolist()]
        refused = [
            t for t in range(logits.shape[1]) if t >= 32 * words or not (m[t // 32] >> (t % 32)) & 1
        ]
        out[r, refused] = float("-inf")
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [4096, 4099, 32000, 32017, 151936])
def test_the_kernel_gives_the_torch_paths_bits(vocab: int, dtype: torch.dtype) -> None:
    logits, mask = _case(7, vocab, -(-vocab // 32), dtype, seed=vocab)
    for rows in ([0, 2, 5], list(range(7)), [6, 1]):
        ours, theirs = logits.clone(), logits.clone()
        assert native.apply_bitmask_(ours, mask, rows)
        _unpack_and_mask(theirs, mask, rows)
        assert torch.equal(_bits(ours), _bits(theirs)), rows
        untouched = [r for r in range(7) if r not in rows]
        assert torch.equal(_bits(ours[untouched]), _bits(logits[untouched]))
        refused = ours[rows].isneginf() & ~logits[rows].isneginf()
        assert refused.any() and not refused.all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, words", [(100, 3), (100, 4), (100, 9), (64, 1), (33, 2)])
def test_masks_narrower_and_wider_than_the_vocabulary(
    vocab: int, words: int, dtype: torch.dtype
) -> None:
    """Tokens past the mask's 32 * words are refused (as llguidance does); words past the
    vocabulary are ignored."""
    logits, mask = _case(3, vocab, words, dtype, seed=words)
    want = _expected(logits, mask, [0, 2])
    for fill in (apply_mask, _unpack_and_mask):
        got = logits.clone()
        fill(got, mask, [0, 2])
        assert torch.equal(_bits(got), _bits(want)), fill


@needs_kernels
def test_the_bits_do_not_depend_on_the_threads() -> None:
    logits, mask = _case(16, 151936, 4748, torch.float32, seed=1)
    rows = [0, 2, 4, 6, 8, 10, 12, 14, 15]
    runs = []
    for threads in (1, 4):
        native.set_threads(threads)
        try:
            got = logits.clone()
            apply_mask(got, mask, rows)
            runs.append(got)
        finally:
            native.set_threads(None)
    assert torch.equal(_bits(runs[0]), _bits(runs[1]))
    assert torch.equal(_bits(runs[0]), _bits(_expected(logits, mask, rows)))


def test_what_the_kernel_does_not_take_falls_back_to_torch() -> None:
    """float64 logits are not the kernels' (nor would another device's be): `apply_mask`
    unpacks the bits with torch there."""
    logits, mask = _case(4, 300, 10, torch.float64, seed=3)
    assert not native.apply_bitmask_(logits.clone(), mask, [1, 3])
    got = logits.clone()
    apply_mask(got, mask, [1, 3])
    assert torch.equal(got.isneginf(), _expected(logits, mask, [1, 3]).isneginf())


@needs_kernels
def test_a_strided_mask_falls_back_to_torch_with_the_same_bits() -> None:
    """The kernel takes contiguous masks only (a copy would be one more torch call on the
    forward's thread): a strided one is left to the torch path, which gives the same bits."""
    logits, mask = _case(4, 300, 10, torch.float32, seed=4)
    strided = torch.zeros(4, 20, dtype=torch.int32)[:, ::2]
    strided.copy_(mask)
    assert not strided.is_contiguous()
    assert not native.apply_bitmask_(logits.clone(), strided, [0, 3])
    got = logits.clone()
    apply_mask(got, strided, [0, 3])
    assert torch.equal(_bits(got), _bits(_expected(logits, mask, [0, 3])))
