"""The native CPU kernels on torch tensors: the one library of `kvtier/kernels/` (built on first
use, cached per CPU; None where it cannot be, logged once, and the model keeps its torch paths),
called through ctypes, which releases the GIL while a kernel runs. Each call checks its tensors
here, with a ValueError naming the input, since the C trusts every shape and stride it is given
(docs/architecture.md §Kernels)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.kernels import abi
from kvtier.kernels import build as kernel_build

log = logging.getLogger("kvtier.model")

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # element types the kernels take
# a KV cache's element types (kernels/csrc/internal.h KV_*): the queries' dtype, or fp8 codes
KV_DTYPES = {**DTYPES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
MAX_NORM_DIM, MAX_HEAD_DIM = 8192, 512  # the kernels' stack buffers (kvtier.h)
# kvtier_linear_available's answers (4: widened to float32 on AVX-512 without BF16)
LINEAR_KINDS = {0: None, 1: "amx", 2: "avx512bf16", 3: "avx2", 4: "avx512"}
I8_KINDS = {0: None, 1: "avx512", 2: "avx2"}  # kvtier_linear_i8_available's
W8A8_KINDS = {0: None, 1: "avx512vnni", 2: "avx2", 3: "avx512"}  # kvtier_linear_w8a8_available's
CPU = torch.device("cpu")


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """The boundary check of every call (not an assert: it must hold under `python -O`).
    `message` is the error's text, or a function making it: a message that shows values is
    made only on failure, since formatting every call's messages was half of a small linear's
    call."""
    if not ok:
        raise ValueError(message if isinstance(message, str) else message())


def _host(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """`t` is on the host CPU in one of DTYPES (or exactly `dtype`)."""
    _require(t.device.type == "cpu",
             lambda: f"{name} must be on the CPU for the native kernels, got "
             f"{t.device}")  # fmt: skip
    want = "float32 or bfloat16" if dtype is None else str(dtype)
    _require(t.dtype in DTYPES if dtype is None else t.dtype == dtype,
             lambda: f"{name} must be {want} for the native kernels, got {t.dtype}")  # fmt: skip


def _contiguous(name: str, t: torch.Tensor) -> None:
    _require(t.is_contiguous(), lambda: f"{name} must be contiguous (call .contiguous()), got "
             f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")  # fmt: skip


def _elements(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """`t` holds as many elements as a tensor of `shape`."""
    _require(t.numel() == math.prod(shape),
             lambda: f"{name} must be {list(shape)}, got shape {tuple(t.shape)}")  # fmt: skip


@dataclass(frozen=True)
class Kernels:
    """The loaded library and where it came from; `tile_linear`: which instructions the bfloat16
    linear runs on here ("amx": AMX tiles, granted by the OS; "avx512bf16": VDPBF16PS; "avx2":
    the tiles widened to float32 FMAs, no AVX-512; "avx512": the same on 512-bit registers, AVX-512
    without BF16; None: none, oneDNN serves every linear);
    `f32_linear`: the batch-invariant float32 linear is built (AVX-512F or AVX2); `i8_linear`:
    the int8-weight linear (W8A16)'s int16 blocks ("avx512": AVX-512 with BW, by VPDPWSSD or,
    without VNNI, VPMADDWD; "avx2": AVX2 without AVX-512; None: not built); `w8a8_linear`: the
    int8 linear with int8 activations (W8A8) ("avx512vnni": VPDPBUSD; without AVX512-VNNI x in
    int16, on W8A16's int16 blocks with AVX-512, "avx512", or AVX2's, "avx2"; None: not built)."""

    lib: ctypes.CDLL
    path: Path
    tile_linear: str | None
    f32_linear: bool
    i8_linear: str | None = None
    w8a8_linear: str | None = None

    def attention_tiles(self, use: bool | None = None) -> bool:
        """Whether the attention kernel runs its small work items (≤ 16 query rows: decodes and
        short drafts; bfloat16, head_dim a multiple of 32 up to 128) on AMX tiles, which the OS
        grants here or not. `use` False puts them on the AVX512-BF16 path until True turns the
        tiles back on (the tests compare both); None only asks."""
        return bool(self.lib.kvtier_attention_amx(-1 if use is None else int(use)))

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        index: tuple[torch.Tensor, ...],
        scale: float,
        softcap: float | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write the attention of the queries `index` names into their rows of `out`.

        q [T, H, D] (rows may be strided), kv_cache [blocks, 2, block_size, kv_heads, D]
        contiguous, out [T, H, D] contiguous, all of one dtype in DTYPES on the CPU — or the
        cache fp8 (8-bit KV: codes of k / k_scale and v / v_scale, read in registers); index =
        (tables [n, max_blocks], seq_token [n], seq_qlen [n], seq_row [n], lo [rows], hi [rows]),
        int64, contiguous, as `paged.NativePlan` builds them (their values are not checked)."""
        _host("q", q)
        _require(
            q.dim() == 3, lambda: f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}"
        )
        _, num_heads, dim = q.shape
        _require(q.stride(2) == 1 and q.stride(1) == dim,
                 lambda: f"q's heads must be contiguous rows (strides (any, {dim}, 1)), got "
                 f"strides {tuple(q.stride())}")  # fmt: skip
        _require(kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[4] == dim,
                 lambda: f"kv_cache must be [blocks, 2, block_size, kv_heads, {dim}], got shape "
                 f"{tuple(kv_cache.shape)}")  # fmt: skip
        _require(dim % 16 == 0 and dim <= MAX_HEAD_DIM,
                 lambda: f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got "
                 f"{dim}")  # fmt: skip
        kv_heads = kv_cache.shape[3]
        _require(num_heads % kv_heads == 0,
                 lambda: f"q's {num_heads} heads are not a multiple of the cache's {kv_heads} "
                 "KV heads")  # fmt: skip
        _require(out.shape == q.shape, lambda: f"out must have q's shape {tuple(q.shape)}, got "
                 f"{tuple(out.shape)}")  # fmt: skip
        _host("out", out, q.dtype)
        _contiguous("out", out)
        fp8 = kv_cache.dtype in KV_DTYPES and kv_cache.dtype not in DTYPES
        if not fp8:
            _host("kv_cache", kv_cache, q.dtype)
        _require(
            kv_cache.device == CPU, lambda: f"kv_cache must be on the CPU, got {kv_cache.device}"
        )
        _contiguous("kv_cache", kv_cache)
        _require(len(index) == 6, lambda: f"index must be the 6 tensors of NativePlan.index(), got "
                 f"{len(index)}")  # fmt: skip
        for name, t in zip(("tables", "seq_token", "seq_qlen", "seq_row", "lo", "hi"), index,
                           strict=True):  # fmt: skip
            _host(f"index {name}", t, torch.int64)
            _contiguous(f"index {name}", t)
        tables, seq_token, seq_qlen, seq_row, lo, hi = index
        n = seq_token.shape[0]
        _require(tables.dim() == 2 and tables.shape[0] == n == seq_qlen.shape[0] == seq_row.shape[0]
                 and lo.shape == hi.shape,
                 lambda: "index: tables [n, blocks], seq_token, seq_qlen, seq_row [n] and lo, hi "
                 f"[rows], got {[tuple(t.shape) for t in index]}")  # fmt: skip
        status = self.lib.kvtier_paged_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_token.data_ptr(), seq_qlen.data_ptr(),
            seq_row.data_ptr(), lo.data_ptr(), hi.data_ptr(), n, num_heads, kv_heads, dim,
            kv_cache.shape[2], scale, softcap or 0.0, DTYPES[q.dtype], KV_DTYPES[kv_cache.dtype],
            k_scale, v_scale, threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("kvtier_paged_attention: no scratch memory for its work items")

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        gemma: bool,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of the rows of x [..., dim] (2-D, or 3-D: q [T, H, D] views) into a new
        contiguous tensor; with `residual` (contiguous, x's shape), residual += x first (in
        place) and the sum is normalized."""
        _host("x", x)
        _require(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got shape {tuple(x.shape)}")
        dim = x.shape[-1]
        _require(x.stride(-1) == 1, lambda: f"x's last dim must be contiguous, got strides "
                 f"{tuple(x.stride())}")  # fmt: skip
        _require(
            dim <= MAX_NORM_DIM, lambda: f"norm dim {dim} is above the kernel's {MAX_NORM_DIM}"
        )
        _host("weight", weight, x.dtype)
        _contiguous("weight", weight)
        _require(
            weight.numel() == dim, lambda: f"weight must have {dim} elements, got {weight.numel()}"
        )
        inner, inner_stride = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
        rows = x.numel() // dim
        out = torch.empty(x.shape, dtype=x.dtype)
        if residual is not None:
            _host("residual", residual, x.dtype)
            _contiguous("residual", residual)
            _require(residual.shape == x.shape, lambda: f"residual must have x's shape "
                     f"{tuple(x.shape)}, got {tuple(residual.shape)}")  # fmt: skip
        self.lib.kvtier_rms_norm(
            x.data_ptr(), x.stride(0), inner, inner_stride,
            None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, dim, eps, int(gemma), DTYPES[x.dtype], threads(),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] (heads D apart, tokens any stride) in place by cos/sin
        [T, 1, D] (contiguous, x's dtype); returns x."""
        _host("x", x)
        _require(
            x.dim() == 3, lambda: f"x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}"
        )
        tokens, heads, dim = x.shape
        _require(x.stride(2) == 1 and x.stride(1) == dim,
                 lambda: f"x's heads must be contiguous rows (strides (any, {dim}, 1)), got "
                 f"strides {tuple(x.stride())}")  # fmt: skip
        _require(dim % 2 == 0 and dim <= MAX_HEAD_DIM,
                 lambda: f"head_dim must be even and at most {MAX_HEAD_DIM}, got "
                 f"{dim}")  # fmt: skip
        for name, t in (("cos", cos), ("sin", sin)):
            _host(name, t, x.dtype)
            _contiguous(name, t)
            _elements(name, t, (tokens, 1, dim))
        self.lib.kvtier_rope(
            x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), tokens,
            DTYPES[x.dtype], threads(),
        )  # fmt: skip
        return x

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of gate_up [rows, 2 * inter] (contiguous) → [rows, inter]."""
        _host("gate_up", gate_up)
        _contiguous("gate_up", gate_up)
        _require(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
                 lambda: "gate_up must be [rows, 2 * inter], got shape "
                 f"{tuple(gate_up.shape)}")  # fmt: skip
        _require(activation in ACTIVATIONS,
                 lambda: f"activation must be one of {sorted(ACTIVATIONS)}, got "
                 f"{activation!r}")  # fmt: skip
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self.lib.kvtier_act_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, ACTIVATIONS[activation],
            DTYPES[gate_up.dtype], threads(),
        )  # fmt: skip
        return out

    def apply_bitmask(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        """Set to -inf, in place, every logit of the rows `rows` (each in range) of logits
        [num_rows, vocab] (float32 or bfloat16, rows contiguous) whose bit in the same row of
        `mask` (int32 [num_rows, words], contiguous; bit j of word w: token 32 w + j,
        llguidance's bitmask) is 0, and every token past 32 * words. `rows` are Python ints,
        checked and passed without a torch call: each torch call releases the GIL, and the
        sampler calls this on the forward op's thread while the engine loop waits for it."""
        _host("logits", logits)
        _require(logits.dim() == 2 and logits.stride(1) == 1,
                 lambda: f"logits must be [rows, vocab] with contiguous rows, got shape "
                 f"{tuple(logits.shape)} strides {tuple(logits.stride())}")  # fmt: skip
        _host("mask", mask, torch.int32)
        _contiguous("mask", mask)
        _require(mask.dim() == 2 and mask.shape[0] == logits.shape[0],
                 lambda: f"mask must be [{logits.shape[0]}, words] (a row per logits row), got "
                 f"shape {tuple(mask.shape)}")  # fmt: skip
        if len(rows) == 0:
            return
        low, high = min(rows), max(rows)
        _require(low >= 0 and high < logits.shape[0],
                 lambda: f"rows must be in [0, {logits.shape[0]}), got {low} to {high}")  # fmt: skip
        index = (ctypes.c_int64 * len(rows))(*rows)
        self.lib.kvtier_apply_bitmask(
            logits.data_ptr(), logits.stride(0), logits.shape[1], mask.data_ptr(), mask.shape[1],
            index, len(rows), DTYPES[logits.dtype], threads(),
        )  # fmt: skip

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight [n, k] in the linear kernel's layout: bfloat16 in tiles (needs
        `tile_linear`), float32 in 16-column vectors (needs `f32_linear`)."""
        _host("weight", weight)
        _contiguous("weight", weight)
        _require(
            weight.dim() == 2, lambda: f"weight must be [n, k], got shape {tuple(weight.shape)}"
        )
        n, k = weight.shape
        if weight.dtype == torch.float32:
            _require(self.f32_linear, "the float32 linear kernel is not built here (it "
                     "needs AVX-512F or AVX2): use F.linear")  # fmt: skip
            packed = torch.empty(_packed_size(weight.dtype, n, k), dtype=torch.float32)
            self.lib.kvtier_linear_f32_pack(weight.data_ptr(), n, k, packed.data_ptr())
            return packed
        _require(self.tile_linear is not None, "the bfloat16 tile linear is not built here "
                 "(it needs AVX2 or AVX-512): use F.linear")  # fmt: skip
        packed = torch.empty(_packed_size(weight.dtype, n, k), dtype=torch.bfloat16)
        self.lib.kvtier_linear_pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def pack_linear_i8(self, weight: torch.Tensor) -> torch.Tensor:
        """An int8 weight [n, k] in the tiles of the int8 linear (needs `i8_linear`)."""
        _require(self.i8_linear is not None, "the int8 linear kernel is not built here (it "
                 "needs AVX-512 or AVX2): dequantize the weight and use F.linear")  # fmt: skip
        return self._pack_int8(weight, self.lib.kvtier_linear_i8_pack, torch.int8)

    def pack_linear_w8a8(self, weight: torch.Tensor) -> torch.Tensor:
        """An int8 weight [n, k] in the tiles of the W8A8 linear, uint8 (needs `w8a8_linear`)."""
        _require(self.w8a8_linear is not None, "the W8A8 linear kernel is not built here (it needs "
                 "AVX512-VNNI or AVX2): use quant.w8a8_reference")  # fmt: skip
        return self._pack_int8(weight, self.lib.kvtier_linear_w8a8_pack, torch.uint8)

    @staticmethod
    def _pack_int8(
        weight: torch.Tensor, pack: Callable[..., None], dtype: torch.dtype
    ) -> torch.Tensor:
        _host("weight", weight, torch.int8)
        _contiguous("weight", weight)
        _require(
            weight.dim() == 2, lambda: f"weight must be [n, k], got shape {tuple(weight.shape)}"
        )
        n, k = weight.shape
        packed = torch.empty(_packed_size(dtype, n, k), dtype=dtype)
        pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear_i8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [m, k] bfloat16 (rows contiguous) times the int8 weight [n, k]ᵀ packed by
        `pack_linear_i8`, column j scaled by scales[j] (float32 [n]), (+ bias) → [m, n]
        bfloat16."""
        return self._int8_linear(self.lib.kvtier_linear_i8, torch.int8, x, packed, scales, n,
                                 bias, "dequantize, F.linear")  # fmt: skip

    def linear_w8a8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [m, k] bfloat16 (rows contiguous), each row quantized to int8 with its own scale,
        times the int8 weight [n, k]ᵀ packed by `pack_linear_w8a8`, column j scaled by scales[j]
        (float32 [n]), (+ bias) → [m, n] bfloat16; the bits of `quant.w8a8_reference`."""
        _require(x.dim() < 2 or x.shape[1] < W8A8_MAX_K,
                 lambda: f"the W8A8 linear sums k < {W8A8_MAX_K} products exactly in int32, "
                 f"got k = {x.shape[1]}: use quant.w8a8_reference")  # fmt: skip
        return self._int8_linear(self.lib.kvtier_linear_w8a8, torch.uint8, x, packed, scales, n,
                                 bias, "quant.w8a8_reference")  # fmt: skip

    def _int8_linear(
        self,
        fn: Callable[..., int],
        weight_dtype: torch.dtype,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        instead: str,
    ) -> torch.Tensor:
        """One call of an int8-weight linear (`fn`, of kvtier.h's signature), its inputs checked;
        `instead`: what to use where it is not built."""
        m = self._linear_inputs(x, packed, n, bias, torch.bfloat16, weight_dtype)
        _host("scales", scales, torch.float32)
        _contiguous("scales", scales)
        _require(scales.numel() == n,
                 lambda: f"scales must have {n} elements, got {scales.numel()}")  # fmt: skip
        out = torch.empty(m, n, dtype=torch.bfloat16)
        status = fn(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), scales.data_ptr(), n, x.shape[1],
            None if bias is None else bias.data_ptr(), out.data_ptr(), threads(),
        )  # fmt: skip
        if status == -2:
            raise ValueError(f"{fn.__name__}: the kernel is not built here: {instead}")
        if status != 0:
            raise MemoryError(f"{fn.__name__}: no scratch memory")
        return out

    def linear_f32(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [m, k] float32 (rows contiguous) times the packed weight [n, k]ᵀ (+ bias) → [m, n]:
        each output one in-order multiply-add chain, so a row's bits do not depend on its
        batch."""
        m = self._linear_inputs(x, packed, n, bias, torch.float32)
        out = torch.empty(m, n, dtype=torch.float32)
        status = self.lib.kvtier_linear_f32(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, x.shape[1],
            None if bias is None else bias.data_ptr(), out.data_ptr(), threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError("the float32 linear kernel is not built here (no AVX-512F or AVX2)")
        return out

    def linear_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [m, k] (rows contiguous) times the packed weight [n, k]ᵀ (+ bias) → [m, n], the
        bits of oneDNN's bfloat16 linear."""
        m = self._linear_inputs(x, packed, n, bias, torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        status = self.lib.kvtier_linear(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, x.shape[1],
            None if bias is None else bias.data_ptr(), out.data_ptr(), threads(),
        )  # fmt: skip
        if status == -2:
            raise ValueError("the bfloat16 tile linear is not built here: use F.linear")
        if status != 0:
            raise MemoryError("kvtier_linear: no scratch memory")
        return out

    @staticmethod
    def _linear_inputs(
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        weight_dtype: torch.dtype | None = None,
    ) -> int:
        """x's row count, once x, the packed weight (of `weight_dtype`, default x's `dtype`) and
        the bias fit together."""
        weight_dtype = weight_dtype or dtype
        _host("x", x, dtype)
        _require(x.dim() == 2 and x.stride(1) == 1,
                 lambda: f"x must be [m, k] with contiguous rows, got shape {tuple(x.shape)} "
                 f"strides {tuple(x.stride())}")  # fmt: skip
        _host("packed", packed, weight_dtype)
        _contiguous("packed", packed)
        want = _packed_size(weight_dtype, n, x.shape[1])
        _require(packed.numel() == want,
                 lambda: f"packed has {packed.numel()} elements, a [{n}, {x.shape[1]}] weight "
                 f"packs into {want}: pack the weight with "
                 f"{PACKERS.get(weight_dtype, 'pack_linear')}, and pass "
                 "its n")  # fmt: skip
        if bias is not None:
            _host("bias", bias, dtype)
            _contiguous("bias", bias)
            _require(bias.numel() == n, lambda: f"bias must have {n} elements, got {bias.numel()}")
        return int(x.shape[0])


PACKERS = {torch.int8: "pack_linear_i8", torch.uint8: "pack_linear_w8a8"}
W8A8_MAX_K = 65536  # kvtier_linear_w8a8's int32 sums: 255 × 128 × k stays below 2^31


def _packed_size(dtype: torch.dtype, n: int, k: int) -> int:
    """Elements of a [n, k] weight packed for the linear kernel of its dtype (kvtier.h): int8
    (W8A16), uint8 (W8A8) and bfloat16 share the tiles."""
    if dtype == torch.float32:
        return -(-n // 16) * k * 16
    return -(-n // 16) * -(-k // 32) * 512


_threads: int | None = None  # set_threads; None: torch's intra-op thread count


def set_threads(n: int | None) -> None:
    """Threads a kernel call may start (each splits its rows or sequences among them when the
    call has work enough); None follows `torch.get_num_threads()`."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"native kernel threads must be ≥ 1, got {n}")
    _threads = n


def threads() -> int:
    """Threads a kernel call may start now (`set_threads`)."""
    return _threads if _threads is not None else torch.get_num_threads()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of float32 or bfloat16 rows x [n, vocab] (the first maximum, or the
    first NaN); the native one runs at memory speed, where torch's reduction does not."""
    kernels = kernels_for(x) if x.dim() == 2 else None
    if kernels is None or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernels.lib.kvtier_argmax(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), DTYPES[x.dtype],
        threads(),
    )  # fmt: skip
    return out


def top_k_top_p_(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor | None:
    """Filter float32 logits x [n, vocab] in place to each row's top-k and then top-p tokens
    (fused.c `kvtier_top_k_top_p`: a radix select, no sort); the others become -inf. top_k [n]
    int64 (≥ vocab: all), top_p [n] float32 (1.0: all). None, touching nothing, where the kernels
    do not serve x (the caller sorts)."""
    kernels = kernels_for(x) if x.dim() == 2 and x.dtype == torch.float32 else None
    if kernels is None or x.stride(-1) != 1:
        return None
    k = None if top_k is None else top_k.to(CPU, torch.int64).contiguous()
    p = None if top_p is None else top_p.to(CPU, torch.float32).contiguous()
    for name, t in (("top_k", k), ("top_p", p)):
        _require(t is None or t.shape == (x.shape[0],),
                 f"{name} must have one value per row of x ({x.shape[0]}), got shape "
                 f"{None if t is None else tuple(t.shape)}")  # fmt: skip
    status = kernels.lib.kvtier_top_k_top_p(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), None if k is None else k.data_ptr(),
        None if p is None else p.data_ptr(), threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"top-k/top-p filter: no scratch for {x.shape[1]} tokens a row")
    return x


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Each row's token of float32 logits x [n, vocab] (temperature applied, filtered tokens
    -inf) for its uniform u [n] in (0, 1]: the first whose cumulative softmax reaches u (fused.c
    `kvtier_draw`; a row with a NaN or +inf, or only -inf, its argmax). None, touching nothing,
    where the kernels do not serve x (the caller takes torch's softmax and cumulative sum)."""
    kernels = kernels_for(x) if x.dim() == 2 and x.dtype == torch.float32 else None
    if kernels is None or x.stride(-1) != 1:
        return None
    u = u.to(CPU, torch.float32).contiguous()
    _require(u.shape == (x.shape[0],),
             f"u must have one value per row of x ({x.shape[0]}), got shape {tuple(u.shape)}")  # fmt: skip
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernels.lib.kvtier_draw(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), u.data_ptr(), out.data_ptr(), threads()
    )
    return out


def apply_bitmask_(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> bool:
    """`Kernels.apply_bitmask` where the kernels serve logits and mask (host CPU, float32 or
    bfloat16 rows contiguous, mask int32 contiguous): True once done; False, touching nothing,
    elsewhere (the caller unpacks the bits with torch)."""
    kernels = kernels_for(logits) if logits.dim() == 2 and logits.stride(-1) == 1 else None
    if kernels is None or mask.device != CPU or mask.dtype != torch.int32:
        return False
    if not mask.is_contiguous():  # the fill's masks are; a copy would be a torch call
        return False
    kernels.apply_bitmask(logits, mask, rows)
    return True


@contextlib.contextmanager
def pool_yield() -> Iterator[None]:
    """Host work beside the kernels' calls: while inside, the kernel pool's idle helpers sleep
    instead of spinning between jobs (pool.c), so the work gets a core the forward would hold.
    Nothing where the kernels were not built."""
    lib = kernels()
    if lib is None:
        yield
        return
    lib.lib.kvtier_pool_yield(1)
    try:
        yield
    finally:
        lib.lib.kvtier_pool_yield(0)


def describe(k: Kernels | None) -> str:
    """Where each kernel family runs with `k` (the start-up log says it once a model loads)."""
    if k is None:
        return "native kernels not built (no C compiler, or the build failed): torch ops serve"
    return (
        f"native kernels {k.path.name}: bfloat16 linear on {k.tile_linear or 'oneDNN'}, "
        f"int8 weights (W8A16) on {k.i8_linear or 'none (dequantized per call)'}, "
        f"int8 activations (W8A8) on {k.w8a8_linear or 'none (torch ops)'}, "
        f"float32 linear {'native' if k.f32_linear else 'in torch'}"
    )


def pool_stats() -> dict[str, int]:
    """The kernel pool's counters since the process started (pool.c): calls run with helpers,
    calls run alone because helpers did not pay lately (a co-tenant on their cores), and the
    spells alone begun. Zeros where the kernels were not built."""
    lib = kernels()
    out = (ctypes.c_int64 * 3)()
    if lib is not None:
        lib.lib.kvtier_pool_stats(out)
    return dict(zip(("with_helpers", "alone", "spells_alone"), out, strict=True))


def kernels_for(x: torch.Tensor) -> Kernels | None:
    """The kernels, if they serve `x` (see `usable`)."""
    return kernels() if usable(x) else None


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels serve tensors of `x`'s dtype and device (the host CPU: not another
    device, nor a stand-in for one such as the placement audit's `cpu:1`), and were built."""
    return x.device == CPU and x.dtype in DTYPES and kernels() is not None


def attention_usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the attention kernel serves queries of `q`'s dtype and device (any tensor of
    them) over `kv_cache` (of q's dtype, or fp8): head_dim a multiple of 16, at most
    MAX_HEAD_DIM."""
    dim = kv_cache.shape[-1]
    fp8 = kv_cache.dtype in KV_DTYPES and kv_cache.dtype not in DTYPES
    return (
        usable(q) and (kv_cache.dtype == q.dtype or fp8) and dim % 16 == 0 and dim <= MAX_HEAD_DIM
    )


@functools.cache
def kernels() -> Kernels | None:
    """The kernels built for `$KVTIER_CPU_ISA` (native: this CPU), building them on first use;
    None where they cannot be."""
    return build()


def build(isa: str | None = None) -> Kernels | None:
    """Build (or find in the cache) and load the library for `isa` (an -march value; None:
    `$KVTIER_CPU_ISA`, else native)."""
    path = kernel_build.build(isa)
    if path is None:
        return None
    try:
        lib = abi.load(path)
    except OSError as exc:
        log.warning("could not load %s (%s): native kernels off", path, exc)
        return None
    return Kernels(
        lib,
        path,
        LINEAR_KINDS[lib.kvtier_linear_available()],
        lib.kvtier_linear_f32_available() == 1,
        I8_KINDS[lib.kvtier_linear_i8_available()],
        W8A8_KINDS[lib.kvtier_linear_w8a8_available()],
    )
