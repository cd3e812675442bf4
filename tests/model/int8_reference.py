"""The int8 linear's int16-block arithmetic in torch, bit for bit (linear_i8_avx512.c's few-rows
path and linear_i8_avx2.c): x's k blocks of 32 scaled by a power of two into int16 (rounded to
nearest even), each block's int32 sum exact, scaled into one float32 accumulator a column in k
order, the column scale, the bias, one bfloat16 rounding. No torch import beyond torch, so the
portable build's subprocess can use it too."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def int16_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] bfloat16 → (int16 values [rows, k blocks, 32] as float64, float32 block scales
    [rows, k blocks]): a block whose largest magnitude a has 2^e ≤ a < 2^(e + 1) is x · 2^(14 - e);
    an all-zero block has scale 0 (finite x only)."""
    rows, k = x.shape
    blocks = F.pad(x.double(), (0, -k % 32)).view(rows, -1, 32)
    amax = blocks.abs().amax(-1)
    e = torch.frexp(amax).exponent - 1  # frexp's mantissa is in [0.5, 1)
    xq = torch.round(torch.ldexp(blocks, (14 - e)[..., None].double()))
    xs = torch.ldexp(torch.ones_like(amax), (e - 14).double()).float()
    return xq, torch.where(amax == 0, torch.zeros_like(xs), xs)


def linear_i8_bits(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, k] bfloat16 · (q int8 [n, k] · scale [n])ᵀ (+ bias bfloat16 [n]) → bfloat16, as
    the kernel computes it. A block's scaled sum is exact (a power of two times a float32), so
    torch's multiply then add rounds as the kernel's FMA does."""
    xq, xs = int16_blocks(x)
    wq = F.pad(q.long(), (0, -q.shape[1] % 32)).view(q.shape[0], -1, 32)
    acc = torch.zeros(x.shape[0], q.shape[0])
    for kb in range(xq.shape[1]):
        acc = acc + (xq[:, kb].long() @ wq[:, kb].T).float() * xs[:, kb, None]
    out = acc * scale.float()
    return (out if bias is None else out + bias.float()).bfloat16()
