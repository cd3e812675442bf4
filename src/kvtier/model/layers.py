"""Building blocks of the decoder: RMSNorm (Llama and Gemma flavours), rotary tables and their
application, the gated MLP. Numerics follow `transformers`' eager modules so goldens match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model.arch import RopeSpec


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norms, softmax and rope: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Llama: w * norm(x) in the input dtype; Gemma: norm(x) * (1 + w) in float32."""

    def __init__(self, dim: int, eps: float, gemma: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by the tables (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.activation == "silu":
            act = F.silu(gate)
        else:
            act = F.gelu(gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        out: torch.Tensor = self.down_proj(act * up)
        return out
