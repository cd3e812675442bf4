"""The Mamba2 recurrence as plain tensor functions: the causal depthwise conv with its carried
state, the chunked state-space-duality scan for prefill chunks, and the one-token recurrent step for
decodes. Every state comes in as an argument and the new state goes out as a result.

Per head h with scalar decay A_h < 0, at each token t: dt_t > 0, x_t [P], B_t and C_t [N]:
    state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t ⊗ B_t        ([P, N])
    y_t     = state_t C_t + D_h x_t                            ([P])
The scan computes the same thing in chunks of Q tokens: inside a chunk as a masked
attention-like product, across chunks through the state at each chunk's start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [n, L, C] after state [n, C, K - 1] (the K - 1 inputs before
    it); weight [C, K]. Returns (out [n, L, C] before activation, new state [n, C, K - 1])."""
    kernel = weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [n, C, K - 1 + L]
    out = F.conv1d(full, weight[:, None, :], bias, groups=weight.shape[0])  # [n, C, L]
    return out.transpose(1, 2), full[:, :, full.shape[-1] - (kernel - 1) :]


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: x [L, H, P], dt [L, H], a [H] (the negative decay rates),
    b and c [L, G, N], d [H], state [H, P, N] before the first token. Returns (y [L, H, P], the
    state after the last token [H, P, N]), both in the inputs' dtype (at least float32)."""
    length, heads, _ = x.shape
    q = max(1, min(chunk_size, length))
    pad = -length % q
    rep = heads // b.shape[1]
    b = b.repeat_interleave(rep, dim=1)  # [L, H, N]
    c = c.repeat_interleave(rep, dim=1)
    xdt = x * dt[..., None]  # [L, H, P]
    decay = dt * a  # [L, H], ≤ 0
    # Padded tokens have dt = 0: they neither decay the state nor add to it.
    xdt, decay, b, c = (_chunks(t, pad, q) for t in (xdt, decay, b, c))  # [n, Q, ...]
    seg = _segment_sums(decay)  # [n, Q(l), Q(s), H]: Σ decay over (s, l], -inf above the diagonal
    within = torch.exp(seg)
    scores = torch.einsum("clhn,cshn->clsh", c, b) * within
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)  # contributions from inside the chunk
    to_end = within[:, -1]  # [n, Q(s), H]: decay from token s to the chunk's last token
    local = torch.einsum("csh,cshn,cshp->chpn", to_end, b, xdt)  # chunk's own end state
    total = torch.exp(decay.sum(dim=1))  # [n, H]: decay over the whole chunk
    starts = []
    for i in range(xdt.shape[0]):  # the recurrence across chunks, one state per chunk
        starts.append(state)
        state = total[i][:, None, None] * state + local[i]
    start = torch.stack(starts)  # [n, H, P, N]
    from_start = torch.exp(torch.cumsum(decay, dim=1))  # [n, Q, H]
    y = y + torch.einsum("clhn,chpn->clhp", c, start) * from_start[..., None]
    y = y.reshape(-1, heads, x.shape[-1])[:length] + d[:, None] * x
    return y, state


def ssm_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of n sequences: x [n, H, P], dt [n, H], b and c [n, G, N], state [n, H, P, N].
    Returns (y [n, H, P], the new state [n, H, P, N])."""
    rep = x.shape[1] // b.shape[1]
    b = b.repeat_interleave(rep, dim=1)  # [n, H, N]
    c = c.repeat_interleave(rep, dim=1)
    keep = torch.exp(dt * a)[..., None, None]  # [n, H, 1, 1]
    state = state * keep + (x * dt[..., None])[..., None] * b[:, :, None, :]
    y = torch.einsum("nhpk,nhk->nhp", state, c) + d[:, None] * x
    return y, state


def _chunks(t: torch.Tensor, pad: int, q: int) -> torch.Tensor:
    """[L, ...] → [n, Q, ...] with `pad` zero tokens at the end."""
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, q, *t.shape[1:])


def _segment_sums(decay: torch.Tensor) -> torch.Tensor:
    """decay [n, Q, H] → [n, Q, Q, H] with [l, s] = Σ_{s < j ≤ l} decay_j, -inf where s > l.

    Summed term by term (a cumulative sum of a masked matrix) rather than as a difference of two
    running sums, which would cancel large magnitudes."""
    q = decay.shape[1]
    terms = decay[:, :, None, :].expand(-1, q, q, -1)  # [n, Q(j), Q(s), H] = decay_j
    after = torch.tril(torch.ones(q, q, dtype=torch.bool, device=decay.device), diagonal=-1)
    sums = torch.cumsum(terms.masked_fill(~after[None, :, :, None], 0.0), dim=1)  # over j ≤ l
    causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=decay.device))
    return sums.masked_fill(~causal[None, :, :, None], float("-inf"))
