"""Int8 weights, with bfloat16 or float32 activations (W8A16) or with activations quantized to int8
a row at a time as they arrive (W8A8, dynamic per token): the linear that runs them, the one
checkpoint format read (compressed-tensors, symmetric per-output-channel int8, as llm-compressor
writes it) and the quantizer the `int8` and `w8a8` load options and the test models use. It owns
no model structure: the loader decides which linears are int8 (docs/kernels.md, "Linear layers,
int8 weights")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import QUANTIZATIONS
from kvtier.model import native as native_kernels

__all__ = [
    "QUANTIZATIONS",
    "Int8Linear",
    "int8_config",
    "int8_tensors",
    "quantize_int8",
    "w8a8_reference",
]
CT_FORMATS = ("int-quantized", "pack-quantized")  # compressed-tensors' formats of int8 weights
QMAX = 127  # symmetric int8: the scale maps a channel's largest |w| to 127
# compressed-tensors' W8A8 activations that kvtier runs: int8, symmetric, one scale a token,
# computed as each batch arrives (llm-compressor's W8A8 recipe; vLLM's dynamic per-token int8)
W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                    "dynamic": True}  # fmt: skip


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale float32 [n]) with weight ≈ q * scale[:, None]: symmetric, one scale
    per output channel (its largest magnitude over 127), rounded to nearest."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [n, k] int8 times its column scales [n], in float32, rounded once to `dtype`."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int8 [m, k], scale float32 [m]) with x ≈ xq * scale[:, None]: each row's largest
    magnitude over 127, x times the scale's inverse (taken in float64) rounded to nearest even
    and clamped to [-128, 127], as vLLM's dynamic per-token int8 does it (compressed-tensors'
    own fake quantization divides by 127.5). A row of zeros has scale 0; a row with a NaN or an
    infinity has scale NaN (its outputs are NaN) and zeros."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)
    scale = amax / QMAX
    inverse = (1.0 / scale.double()).to(torch.float32)
    q = torch.round(xf * inverse[:, None]).clamp(-QMAX - 1, QMAX)
    q[bad | (amax == 0)] = 0
    return q.to(torch.int8), scale.masked_fill(bad, float("nan"))


def w8a8_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The W8A8 linear in torch ops, the kernel's bits (`native.linear_w8a8`): x's rows
    quantized (`quantize_rows`), int32 sums of int8 products (exact), then (sum × column scale) ×
    row scale in float32, the bias, one rounding to x's dtype."""
    xq, xs = quantize_rows(x)
    # float64 holds every sum exactly (|sum| ≤ 128 · 127 · k, far below 2^53), then float32 as
    # the kernel's int32 → float32 conversion rounds it
    acc = (xq.to(torch.float64) @ q.to(torch.float64).t()).to(torch.float32)
    out = (acc * scale.to(torch.float32)[None, :]) * xs[:, None]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer of int8 weights [n, k] and float32 scales [n] (weight = q * scale), any
    activation dtype. W8A16: bfloat16 rows on the host CPU go to the int8 tile kernel
    (linear_i8*.c: int8 widened in registers, one float32 sum a column, scaled once) where it is
    built; anything else multiplies a bfloat16/float32 copy dequantized per call (`dequantize`),
    which is what the kernel computes up to the order of float32 sums and the weight's one
    rounding. W8A8 (`int8_activations`): each row of x is quantized to int8 first, on the W8A8
    kernel (linear_w8a8_avx512.c, linear_w8a8_avx2.c) where it is built, else in torch ops with its bits
    (`w8a8_reference`)."""

    _tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    _tiles_of: tuple[int, int] | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, int8_activations: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.int8_activations = int8_activations
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels(x)
        bias = self.bias
        if kernels is not None and (bias is None or bias.dtype == torch.bfloat16):
            packed, scale = self.tiles(kernels)
            if self.int8_activations:
                return kernels.linear_w8a8(x, packed, scale, self.out_features, bias)
            return kernels.linear_i8(x, packed, scale, self.out_features, bias)
        if self.int8_activations:
            rows = x.reshape(-1, self.in_features)
            out = w8a8_reference(rows, self.weight, self.weight_scale, bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        w = dequantize(self.weight, self.weight_scale, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def _kernels(self, x: torch.Tensor) -> native_kernels.Kernels | None:
        """The native kernels where they take x's rows: bfloat16 [m, k] with contiguous rows, on
        the host CPU, with this linear's kernel (W8A16 or W8A8) built."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            return None
        if x.device != native_kernels.CPU or self.weight.device != native_kernels.CPU:
            return None
        kernels = native_kernels.kernels()
        return kernels if kernels is not None and self.kernel_serves(kernels) else None

    def kernel_serves(self, kernels: native_kernels.Kernels) -> bool:
        """Whether `kernels` has this linear's kernel (W8A16's or W8A8's) for its shape."""
        if self.int8_activations:
            return kernels.w8a8_linear is not None and self.in_features < native_kernels.W8A8_MAX_K
        return kernels.i8_linear is not None

    def tiles(self, kernels: native_kernels.Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(the int8 weight in the kernel's tiles, W8A16's or W8A8's, float32 scales), made on
        first use and again whenever the weight or scale tensor is another one."""
        key = (self.weight.data_ptr(), self.weight_scale.data_ptr())
        if self._tiles is None or self._tiles_of != key:
            weight = self.weight.detach().contiguous()
            pack = kernels.pack_linear_w8a8 if self.int8_activations else kernels.pack_linear_i8
            packed = pack(weight)
            scale = self.weight_scale.detach().to(torch.float32).contiguous()
            self._tiles, self._tiles_of = (packed, scale), key
        return self._tiles

    def extra_repr(self) -> str:
        acts = ", int8 activations per token" if self.int8_activations else ""
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel{acts}"


def int8_config(config: Mapping[str, Any], source: object) -> dict[str, Any] | None:
    """A config.json's `quantization_config` if it is compressed-tensors int8 weights, weight-only
    or with int8 activations per token (the schemes and formats kvtier runs); None without one, or with only a `kv_cache_scheme` (KV
    scales, model/kv_scales.py); a ValueError naming what is not supported otherwise."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; kvtier "
            "loads compressed-tensors int8 weights (W8A16 or W8A8, channel-wise), or the "
            "unquantized checkpoint with --quantization int8 or w8a8"
        )
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        fmt_here = group.get("format") or fmt
        want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        got = {key: w.get(key) for key in want}
        if got != want or fmt_here not in CT_FORMATS:
            raise ValueError(
                f"{source}: quantization_config.config_groups.{name} is {got} in format "
                f"{fmt_here!r}; kvtier runs int8 symmetric channel-wise weights ({want}) in "
                f"{list(CT_FORMATS)}"
            )
        acts = group.get("input_activations")
        if acts is not None:
            got = {key: acts.get(key) for key in W8A8_ACTIVATIONS}
            if got != W8A8_ACTIVATIONS:
                raise ValueError(
                    f"{source}: quantization_config.config_groups.{name}.input_activations is "
                    f"{got}; kvtier runs int8 activations quantized per token as they arrive "
                    f"({W8A8_ACTIVATIONS}), or weight-only int8 (no input_activations)"
                )
    if len({_acts_int8(g) for g in groups.values()}) > 1:
        raise ValueError(
            f"{source}: quantization_config.config_groups mix int8 and unquantized activations; "
            "kvtier runs one scheme a checkpoint (W8A16 or W8A8)"
        )
    if not groups:
        if qc.get("kv_cache_scheme") is not None:  # KV scales only: the weights are as they are
            return None
        raise ValueError(f"{source}: quantization_config has no config_groups")
    return dict(qc)


def int8_activations(config: Mapping[str, Any]) -> bool:
    """Whether a checked `int8_config` quantizes the activations (W8A8, dynamic per token)."""
    groups = config.get("config_groups") or {}
    return any(_acts_int8(g) for g in groups.values())


def _acts_int8(group: Mapping[str, Any]) -> bool:
    return group.get("input_activations") is not None


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """compressed-tensors' pack-quantized 8-bit weight: int32 words of 4 elements each, the
    first in the low byte, stored as value + 128 → int8 [n, k]."""
    n, k = (int(v) for v in shape)
    as_bytes = packed.contiguous().view(torch.uint8).reshape(n, -1)[:, :k]
    return (as_bytes.to(torch.int16) - 128).to(torch.int8)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """`unpack_int8`'s inverse: int8 [n, k] → int32 [n, ceil(k / 4)]."""
    n, k = q.shape
    padded = torch.zeros(n, -(-k // 4) * 4, dtype=torch.uint8)  # zero bits past k
    padded[:, :k] = (q.to(torch.int16) + 128).to(torch.uint8)
    return padded.view(torch.int32)


def int8_tensors(
    raw: dict[str, torch.Tensor], source: object
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Take every int8 linear out of a checkpoint's tensors `raw` (in place): HF module name →
    (q int8 [n, k], scale float32 [n]), from `weight` + `weight_scale` (int-quantized) or
    `weight_packed` + `weight_shape` + `weight_scale` (pack-quantized)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in [k for k in raw if k.endswith(".weight_scale")]:
        module = key.removesuffix(".weight_scale")
        scale = raw.pop(key).to(torch.float32).reshape(-1)
        if f"{module}.weight_packed" in raw:
            q = unpack_int8(raw.pop(f"{module}.weight_packed"), raw.pop(f"{module}.weight_shape"))
        elif f"{module}.weight" in raw:
            q = raw.pop(f"{module}.weight")
        else:
            raise ValueError(f"{source}: {key} has no {module}.weight or .weight_packed")
        if q.dtype != torch.int8 or q.dim() != 2 or scale.numel() != q.shape[0]:
            raise ValueError(
                f"{source}: {module} must be an int8 [n, k] weight with n channel scales, got "
                f"{q.dtype} {tuple(q.shape)} and {scale.numel()} scales"
            )
        raw.pop(f"{module}.weight_zero_point", None)  # symmetric: all zero when written
        out[module] = (q, scale)
    return out
