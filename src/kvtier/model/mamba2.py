"""The Mamba2 mixer (gated, grouped heads, conv state + SSM state) and how one forward addresses its
states: `StateMetadata` (per Mamba KV group, the slot each sequence reads its state from and the
slot it writes the new state to, or a slot per token) and `StatePlan` (that, split into decodes,
prefill chunks and token-by-token queries).

States live in `MambaCache` slot tensors passed to every forward; the mixer holds only weights.
A slot is a block id of the group's table: the state after n tokens is kept at table position
(n - 1) // block_size (kv/specs.py `Mamba`), so a step that crosses a block boundary reads one
block and writes another, and a step ending on a boundary leaves a prefix-cache snapshot.
A query given a slot per token (a draft verification) runs the recurrence one token at a time and
leaves the state after each of its tokens: continuing from the state after the last accepted token
is exactly as if the rejected tokens never ran.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model.hybrid_arch import MixerSpec
from kvtier.model.ssd import causal_conv, ssd_scan, ssm_step


@dataclass(frozen=True)
class MambaCache:
    """One Mamba layer's states by slot: conv [num_slots, conv_dim, K - 1] (the last K - 1 conv
    inputs) and ssm [num_slots, heads, head_dim, state_size]."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass(frozen=True)
class StatePlan:
    """One Mamba group's state reads and writes for one forward (built on the host)."""

    decode_tokens: torch.Tensor  # [n] token row of each one-token sequence
    decode_src: torch.Tensor  # [n] slot holding its state before the token
    decode_dst: torch.Tensor  # [n] slot receiving its state after the token
    decode_fresh: torch.Tensor  # [n] bool: no tokens before (start from the zero state)
    prefills: tuple[tuple[int, int, int, int, bool], ...]  # (first token, end, src, dst, fresh)
    # (first token, end, src, fresh, one dst slot per token): the state after every token
    stepwise: tuple[tuple[int, int, int, bool, tuple[int, ...]], ...] = ()

    def to(self, device: torch.device) -> StatePlan:
        """The plan with its index tensors on `device`."""
        if device == torch.device("cpu"):
            return self
        return StatePlan(
            self.decode_tokens.to(device),
            self.decode_src.to(device),
            self.decode_dst.to(device),
            self.decode_fresh.to(device),
            self.prefills,
            self.stepwise,
        )


@dataclass(frozen=True)
class StateMetadata:
    """One forward's ragged batch as the Mamba layers see it."""

    query_start_loc: tuple[int, ...]  # [num_seqs + 1] token offsets, as in AttentionMetadata
    num_computed_tokens: tuple[int, ...]  # [num_seqs] tokens before this forward's
    src_slots: Mapping[int, tuple[int, ...]]  # per Mamba group: slot of the state to start from
    dst_slots: Mapping[int, tuple[int, ...]]  # per Mamba group: slot for the state at the end
    # per Mamba group, per sequence index: a slot for the state after each of its tokens
    token_slots: Mapping[int, Mapping[int, tuple[int, ...]]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        block_ids: Mapping[int, Sequence[Sequence[int]]],
        block_size: int | Mapping[int, int],
        token_slots: Mapping[int, Mapping[int, Sequence[int]]] | None = None,
    ) -> StateMetadata:
        """From the block tables of the Mamba groups (`block_ids[group][seq]`): the state after n
        tokens is at table position (n - 1) // block_size (one size, or one per group). A
        sequence with no tokens before starts from zeros (its src is never read).
        `token_slots[group][seq]` (one slot per scheduled token) sends that sequence's state
        after each token there instead."""
        loc = [0]
        for n in num_scheduled_tokens:
            loc.append(loc[-1] + n)
        ends = [c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)]
        src: dict[int, tuple[int, ...]] = {}
        dst: dict[int, tuple[int, ...]] = {}
        for group, tables in block_ids.items():
            bs = block_size if isinstance(block_size, int) else block_size[group]
            dst[group] = tuple(
                t[(e - 1) // bs] if e else 0 for t, e in zip(tables, ends, strict=True)
            )
            src[group] = tuple(
                t[(c - 1) // bs] if c else d
                for t, c, d in zip(tables, num_computed_tokens, dst[group], strict=True)
            )
        per_token = {
            g: {i: tuple(slots) for i, slots in seqs.items()}
            for g, seqs in (token_slots or {}).items()
        }
        for g, seqs in per_token.items():
            for i, slots in seqs.items():
                if len(slots) != num_scheduled_tokens[i]:
                    raise ValueError(
                        f"token_slots[{g}][{i}] has {len(slots)} slots for "
                        f"{num_scheduled_tokens[i]} scheduled tokens; give one per token"
                    )
        return cls(tuple(loc), tuple(num_computed_tokens), src, dst, per_token)

    @functools.cached_property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc
        return [loc[i + 1] - loc[i] for i in range(len(loc) - 1)]

    def plan(self, group: int) -> StatePlan:
        """Decodes (one token) batched, longer queries one by one, queries with a slot per token
        token by token; idle sequences skipped."""
        src, dst = self.src_slots[group], self.dst_slots[group]
        per_token = self.token_slots.get(group, {})
        loc, computed = self.query_start_loc, self.num_computed_tokens
        decodes = [i for i, q in enumerate(self.query_lens) if q == 1 and i not in per_token]
        prefills = tuple(
            (loc[i], loc[i + 1], src[i], dst[i], not computed[i])
            for i, q in enumerate(self.query_lens)
            if q > 1 and i not in per_token
        )
        stepwise = tuple(
            (loc[i], loc[i + 1], src[i], not computed[i], slots)
            for i, slots in sorted(per_token.items())
            if slots
        )
        return StatePlan(
            decode_tokens=torch.tensor(
                [self.query_start_loc[i] for i in decodes], dtype=torch.long
            ),
            decode_src=torch.tensor([src[i] for i in decodes], dtype=torch.long),
            decode_dst=torch.tensor([dst[i] for i in decodes], dtype=torch.long),
            decode_fresh=torch.tensor([not self.num_computed_tokens[i] for i in decodes]),
            prefills=prefills,
            stepwise=stepwise,
        )


class GatedRMSNorm(nn.Module):
    """RMSNorm over `num_groups` equal slices, gated by silu(z) before or after (float32)."""

    def __init__(self, dim: int, num_groups: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.num_groups, self.eps, self.norm_before_gate = num_groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = F.silu(z.to(y.dtype))
        if not self.norm_before_gate:
            y = y * gate
        grouped = y.view(*y.shape[:-1], self.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight.to(y.dtype) * grouped.view(y.shape)
        return y * gate if self.norm_before_gate else y


class Mamba2Mixer(nn.Module):
    """in_proj → (z, xBC, dt); causal conv on xBC + silu; the SSM on (x, B, C, dt); gate by z
    (optionally through a grouped RMSNorm); out_proj. Parameter names follow HF."""

    def __init__(self, hidden_size: int, spec: MixerSpec) -> None:
        super().__init__()
        s = spec.shape
        self.spec, self.shape = spec, s
        self.in_proj = nn.Linear(
            hidden_size, s.intermediate_size + s.conv_dim + s.num_heads, spec.in_bias
        )
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=spec.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = (
            GatedRMSNorm(s.intermediate_size, s.num_groups, spec.eps, spec.norm_before_gate)
            if spec.gated_norm
            else None
        )
        self.out_proj = nn.Linear(s.intermediate_size, hidden_size, bias=spec.out_bias)

    def forward(self, x: torch.Tensor, cache: MambaCache, plan: StatePlan) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]; reads each sequence's state from its src slot and writes
        the state after its tokens to its dst slot (in place in `cache`)."""
        s, num_tokens = self.shape, x.shape[0]
        gn = s.num_groups * s.state_size
        z, xbc, dt = self.in_proj(x).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(self.spec.dt_min, self.spec.dt_max)
        compute = torch.promote_types(x.dtype, torch.float32)
        a = -torch.exp(self.A_log.to(compute))
        d = self.D.to(compute)
        weight, bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        y = x.new_empty(num_tokens, s.num_heads, s.head_dim, dtype=compute)
        if plan.decode_tokens.numel() > 0:
            tokens, fresh = plan.decode_tokens, plan.decode_fresh[:, None, None]
            conv = torch.where(fresh, 0.0, cache.conv.index_select(0, plan.decode_src))
            ssm = cache.ssm.index_select(0, plan.decode_src).to(compute)
            ssm = torch.where(fresh[..., None], 0.0, ssm)
            yd, conv, ssm = self._step(
                xbc.index_select(0, tokens), dt.index_select(0, tokens), conv, ssm, a, d
            )
            cache.conv.index_copy_(0, plan.decode_dst, conv.to(cache.conv.dtype))
            cache.ssm.index_copy_(0, plan.decode_dst, ssm.to(cache.ssm.dtype))
            y.index_copy_(0, tokens, yd)
        for start, end, src, is_fresh, slots in plan.stepwise:
            conv, ssm = cache.conv[src : src + 1], cache.ssm[src : src + 1].to(compute)
            if is_fresh:  # a fresh sequence's slot may hold poison: not read
                conv, ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
            for t, slot in zip(range(start, end), slots, strict=True):
                y[t : t + 1], conv, ssm = self._step(xbc[t : t + 1], dt[t : t + 1], conv, ssm, a, d)
                cache.conv[slot] = conv[0].to(cache.conv.dtype)
                cache.ssm[slot] = ssm[0].to(cache.ssm.dtype)
        for start, end, src, dst, is_fresh in plan.prefills:
            length = end - start
            conv = cache.conv[src : src + 1]  # a fresh sequence's slot may hold poison: not read
            conv = torch.zeros_like(conv) if is_fresh else conv
            out, conv = causal_conv(xbc[None, start:end], conv, weight, bias)
            cache.conv[dst] = conv[0].to(cache.conv.dtype)
            xs, b, c = torch.split(F.silu(out[0]).to(compute), [s.intermediate_size, gn, gn], -1)
            ssm = cache.ssm[src].to(compute)
            yp, ssm = ssd_scan(
                xs.view(length, s.num_heads, s.head_dim),
                dt[start:end].to(compute),
                a,
                b.view(length, s.num_groups, s.state_size),
                c.view(length, s.num_groups, s.state_size),
                d,
                torch.zeros_like(ssm) if is_fresh else ssm,
                self.spec.chunk_size,
            )
            cache.ssm[dst] = ssm.to(cache.ssm.dtype)
            y[start:end] = yp
        flat = y.view(num_tokens, s.intermediate_size)
        gated = F.silu(z.to(compute)) * flat if self.norm is None else self.norm(flat, z)
        out_proj: torch.Tensor = self.out_proj(gated.to(x.dtype))
        return out_proj

    def _step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        a: torch.Tensor,
        d: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of n sequences: xbc [n, conv_dim], dt [n, H], conv [n, conv_dim, K - 1],
        ssm [n, H, P, N] → (y [n, H, P], new conv, new ssm)."""
        s, n = self.shape, xbc.shape[0]
        gn = s.num_groups * s.state_size
        bias = self.conv1d.bias
        out, conv = causal_conv(xbc[:, None], conv, self.conv1d.weight[:, 0, :], bias)
        xs, b, c = torch.split(F.silu(out[:, 0]).to(ssm.dtype), [s.intermediate_size, gn, gn], -1)
        y, ssm = ssm_step(
            xs.view(n, s.num_heads, s.head_dim),
            dt.to(ssm.dtype),
            a,
            b.view(n, s.num_groups, s.state_size),
            c.view(n, s.num_groups, s.state_size),
            d,
            ssm,
        )
        return y, conv, ssm
