"""Building blocks of the decoder: linear layers with prepacked bfloat16 weights on CPU, RMSNorm
(Llama and Gemma flavours), rotary tables and their application, the gated MLP. Numerics follow
`transformers`' eager modules so goldens match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model import native as native_kernels
from kvtier.model.arch import RopeSpec


def _can_pack_bf16() -> bool:
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


PACK_BF16 = _can_pack_bf16()  # oneDNN runs bf16 here (AVX-512 BF16 / AMX or emulated)


WIDENED = ("avx2", "avx512")  # tile linears widened to float32 FMAs: oneDNN emulates bfloat16
MAX_TILE_ROWS = 64  # any weight
SMALL_WEIGHT = 2 << 20  # the small models' weights: at most 2M elements, any row count


def takes_tiles(rows: int, numel: int, kind: str | None = None) -> bool:
    """Whether the tile linear of `kind` (`Kernels.tile_linear`) serves `rows` rows of a weight of
    `numel` elements: on the widened paths every call; else up to 64 rows on any weight, any row
    count on weights of at most 2M elements. Why (measured against oneDNN, one call alone, and
    end to end):

    - AVX2 without AVX-512 (AMD Zen 3): oneDNN has no bfloat16 instructions to run and gives
      ~10 GFLOP/s a core at every row count, a sixth of its own float32 rate; the tiles widened to
      float32 gave 4-8× that from 1 to 256 rows (docs/benchmarks.md, "An AVX2 CPU").
    - AVX-512 without its BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): oneDNN emulates
      bfloat16 at ~35 GFLOP/s a core from 1 to 2048 rows; the tiles widened to float32 on 512-bit
      registers gave 2× that at one row and ~3× from 16 rows on (docs/kernels.md).

    - AMX: up to 64 rows the tiles beat oneDNN on any weight, small or streamed from memory;
      above that, on large weights, oneDNN's blocking wins. On small weights the tiles run the
      rows in chunks that keep x in L2 (linear.c) and take the whole step as one call per layer
      (`fused_layer.py`), so a long prefill step gains as well.
    - AVX512-BF16 (AMD Zen 5): both run VDPBF16PS at its peak rate, so what the tiles save is
      oneDNN's set-up per call, which counts at few rows and small shapes and fades on large
      weights. What decides it is the step: with every linear on the tiles a layer runs as one
      call (`fused_layer.py`), and the 0.5B shape's decode step was fastest at every batch size
      with this bound (against oneDNN, and against tiles for fewer rows).

    Bits: a row gets oneDNN's bits in a batch of up to 32 rows (AMX) and wherever oneDNN sums k
    in order (AVX512-BF16: k ≤ 512; with k of 896 and more oneDNN's bits depend on the batch's
    row count, 2-300 outputs in 10^5 one bfloat16 ulp apart) — the tiles give a row the same
    bits whatever its batch."""
    return kind in WIDENED or rows <= MAX_TILE_ROWS or numel <= SMALL_WEIGHT


class Linear(nn.Linear):
    """`nn.Linear` whose weight on a CPU is multiplied through a copy prepacked once. bfloat16:
    for the rows `takes_tiles` gives them, the tile layout of `model/native.py`'s linear kernel
    (AMX, AVX512-BF16, or widened to float32 on AVX2 or AVX-512; at small shapes oneDNN's set-up
    per call costs more than the tiles' whole product), otherwise oneDNN's blocked layout
    (`F.linear` would reorder the weight on every call); the tiles give `F.linear`'s bits where
    oneDNN sums in order (see `takes_tiles`). float32: the native float32 kernel where it
    is built (AVX-512F or AVX2; why: `forward`), else `F.linear`. Either way a row's result does
    not depend on its batch on the native kernels. Copies derive from the weight, not state:
    rebuilt whenever the weight tensor is another one (loading, `.to()`)."""

    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, torch.dtype] | None = None
    _tiles: torch.Tensor | None = None
    _tiles_of: tuple[int, torch.dtype] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        kernels = _row_kernels(x, w)
        if x.dtype == w.dtype == torch.float32 and kernels is not None and kernels.f32_linear:
            # not for speed first (though it beats `F.linear` at every row count measured) but
            # batch invariance: oneDNN's and MKL's float32 GEMMs sum in an
            # order that depends on the row count (on AMD Zen 5 one or three rows differ from
            # eight or more in up to a third of the outputs), so a request's logits, and a seeded
            # sample, would depend on what else is in its batch
            return kernels.linear_f32(x, self.tiles(kernels), w.shape[0], self.bias)
        bf16 = x.dtype == w.dtype == torch.bfloat16
        if (
            bf16
            and kernels is not None
            and kernels.tile_linear
            and takes_tiles(x.shape[0], w.numel(), kernels.tile_linear)
        ):
            return kernels.linear_bf16(x, self.tiles(kernels), w.shape[0], self.bias)
        if not (PACK_BF16 and bf16):
            return F.linear(x, w, self.bias)
        if x.device != native_kernels.CPU or w.device != native_kernels.CPU:
            return F.linear(x, w, self.bias)
        key = (w.data_ptr(), w.dtype)
        if self._packed is None or self._packed_of != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_of = key
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self._packed, self.bias, "none", [], ""
        )
        return out

    def tiles(self, kernels: native_kernels.Kernels) -> torch.Tensor:
        """The weight in the linear kernel's layout (a bfloat16 weight needs
        `kernels.tile_linear`, a float32 one `kernels.f32_linear`), packed on first use and
        again whenever the weight tensor is another one."""
        w = self.weight
        key = (w.data_ptr(), w.dtype)
        if self._tiles is None or self._tiles_of != key:
            self._tiles = kernels.pack_linear(w.detach().contiguous())
            self._tiles_of = key
        return self._tiles


def _row_kernels(x: torch.Tensor, w: torch.Tensor) -> native_kernels.Kernels | None:
    """The native kernels, if x's rows can go to their linears: x and w on the host CPU, x
    [m, k] with contiguous rows."""
    if x.device != native_kernels.CPU or w.device != native_kernels.CPU:
        return None
    if x.dim() != 2 or x.stride(1) != 1:
        return None
    return native_kernels.kernels()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norms, softmax and rope: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Llama: w * norm(x) in the input dtype; Gemma: norm(x) * (1 + w) in float32."""

    def __init__(self, dim: int, eps: float, gemma: bool, native: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma
        self.native = native and dim <= native_kernels.MAX_NORM_DIM  # fused.c where it serves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and native_kernels.usable(x) and self.weight.dtype == x.dtype:
            kernels = native_kernels.kernels()
            assert kernels is not None
            return kernels.rms_norm(x, self.weight, self.eps, self.gemma)
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add before the norm, fused (the
        native kernel updates `residual` in place and returns it)."""
        if self.native and native_kernels.usable(x) and self.weight.dtype == x.dtype:
            kernels = native_kernels.kernels()
            assert kernels is not None and residual.is_contiguous()
            return kernels.rms_norm(x, self.weight, self.eps, self.gemma, residual), residual
        residual = residual + x
        return self.forward(residual), residual


def inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `rope.rope_type` says."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope_tables(
    freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [num_tokens, 1, head_dim] for `positions` [num_tokens], cast to `dtype`."""
    angles = positions.float()[:, None] * freq[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool = True
) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by the tables (rotate-half convention); the native
    kernel rotates x in place (heads head_dim apart) and returns it."""
    dim = x.shape[-1]
    if (
        native
        and dim <= native_kernels.MAX_HEAD_DIM
        and native_kernels.usable(x)
        and x.stride(-1) == 1
        and x.stride(-2) == dim
        and cos.dtype == x.dtype
    ):
        kernels = native_kernels.kernels()
        assert kernels is not None
        return kernels.rope_(x, cos.contiguous(), sin.contiguous())
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(
        self, hidden: int, intermediate: int, activation: str, bias: bool, native: bool = True
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.activation = activation
        self.native = native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native and native_kernels.usable(gate_up) and gate_up.is_contiguous():
            kernels = native_kernels.kernels()
            assert kernels is not None
            fused: torch.Tensor = self.down_proj(kernels.act_mul(gate_up, self.activation))
            return fused
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            act = F.silu(gate)
        else:
            act = F.gelu(gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        out: torch.Tensor = self.down_proj(act * up)
        return out
