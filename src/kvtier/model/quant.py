"""Int8 weights with bfloat16 or float32 activations (W8A16): the linear that runs them, the one
checkpoint format read (compressed-tensors, symmetric per-output-channel int8, as llm-compressor
writes it) and the quantizer both the `int8` load option and the test models use. It owns no
model structure: the loader decides which linears are int8 (docs/kernels.md, "Linear layers,
int8 weights")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import QUANTIZATIONS
from kvtier.model import native as native_kernels

__all__ = ["QUANTIZATIONS", "Int8Linear", "int8_config", "int8_tensors", "quantize_int8"]
CT_FORMATS = ("int-quantized", "pack-quantized")  # compressed-tensors' formats of int8 weights
QMAX = 127  # symmetric int8: the scale maps a channel's largest |w| to 127


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


class Int8Linear(nn.Module):
    """A linear layer of int8 weights [n, k] and float32 scales [n] (weight = q * scale), any
    activation dtype. bfloat16 rows on the host CPU go to the int8 tile kernel (linear_i8*.c:
    int8 widened in registers, one float32 sum a column, scaled once) where it is built; anything
    else multiplies a bfloat16/float32 copy dequantized per call (`dequantize`), which is what
    the kernel computes up to the order of float32 sums and the weight's one rounding."""

    _tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    _tiles_of: tuple[int, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
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
            return kernels.linear_i8(x, packed, scale, self.out_features, bias)
        w = dequantize(self.weight, self.weight_scale, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def _kernels(self, x: torch.Tensor) -> native_kernels.Kernels | None:
        """The native kernels where they take x's rows: bfloat16 [m, k] with contiguous rows, on
        the host CPU, with the int8 linear built."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
            return None
        if x.device != native_kernels.CPU or self.weight.device != native_kernels.CPU:
            return None
        kernels = native_kernels.kernels()
        return kernels if kernels is not None and kernels.i8_linear else None

    def tiles(self, kernels: native_kernels.Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(the int8 weight in the kernel's tiles, float32 scales), made on first use and again
        whenever the weight or scale tensor is another one."""
        key = (self.weight.data_ptr(), self.weight_scale.data_ptr())
        if self._tiles is None or self._tiles_of != key:
            packed = kernels.pack_linear_i8(self.weight.detach().contiguous())
            scale = self.weight_scale.detach().to(torch.float32).contiguous()
            self._tiles, self._tiles_of = (packed, scale), key
        return self._tiles

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel"


def int8_config(config: Mapping[str, Any], source: object) -> dict[str, Any] | None:
    """A config.json's `quantization_config` if it is compressed-tensors int8 weight-only (the
    scheme and format kvtier runs); None without one, or with only a `kv_cache_scheme` (KV
    scales, model/kv_scales.py); a ValueError naming what is not supported otherwise."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; kvtier "
            "loads compressed-tensors int8 weights (W8A16, channel-wise), or the unquantized "
            "checkpoint with --quantization int8"
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
        if group.get("input_activations") is not None:
            raise ValueError(
                f"{source}: quantization_config.config_groups.{name} quantizes activations "
                "(W8A8); kvtier runs weight-only int8 (W8A16): use a W8A16 checkpoint"
            )
    if not groups:
        if qc.get("kv_cache_scheme") is not None:  # KV scales only: the weights are as they are
            return None
        raise ValueError(f"{source}: quantization_config has no config_groups")
    return dict(qc)


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
