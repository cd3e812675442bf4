"""The Mamba2 recurrence functions: the chunked scan equals the token-by-token recurrence for any
length, chunk size and head grouping, from any starting state; the conv with a carried state equals
the conv over the whole sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model.ssd import causal_conv, ssd_scan, ssm_step


def inputs(length: int, heads: int, groups: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, b, c = rand(length, heads, 3), rand(length, groups, 5), rand(length, groups, 5)
    dt = F.softplus(rand(length, heads))
    a = -torch.rand(heads, generator=gen, dtype=torch.float64) * 4  # decays up to exp(-4 dt)
    return x, dt, a, b, c, rand(heads), rand(heads, 3, 5)


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(
    length=st.integers(1, 40),
    chunk=st.integers(1, 48),
    groups_heads=st.sampled_from([(1, 1), (1, 4), (2, 4), (4, 4)]),
    seed=st.integers(0, 99),
)
def test_chunked_scan_equals_the_recurrence(length, chunk, groups_heads, seed):
    groups, heads = groups_heads
    x, dt, a, b, c, d, state = inputs(length, heads, groups, seed)
    y, final = ssd_scan(x, dt, a, b, c, d, state, chunk)
    step_state, ys = state[None], []
    for t in range(length):
        yt, step_state = ssm_step(
            x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], d, step_state
        )
        ys.append(yt[0])
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-11, rtol=0)
    torch.testing.assert_close(final, step_state[0], atol=1e-11, rtol=0)


def test_a_zero_state_and_zero_dt_change_nothing():
    x, dt, a, b, c, d, state = inputs(6, 4, 2, seed=1)
    y, final = ssd_scan(x, torch.zeros_like(dt), a, b, c, d, state, chunk_size=4)
    torch.testing.assert_close(final, state, atol=0, rtol=0)  # no decay, no input
    expected = torch.einsum("hpn,lhn->lhp", state, c.repeat_interleave(2, dim=1)) + d[:, None] * x
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=0)


@given(cut=st.integers(1, 11), kernel=st.integers(2, 5))  # the mixer never passes 0 tokens
def test_conv_with_a_carried_state_equals_the_whole_conv(cut, kernel):
    gen = torch.Generator().manual_seed(kernel)
    x = torch.randn(1, 12, 6, generator=gen, dtype=torch.float64)  # [n, L, C]
    weight = torch.randn(6, kernel, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    zero = torch.zeros(1, 6, kernel - 1, dtype=torch.float64)
    whole, last = causal_conv(x, zero, weight, bias)
    first, state = causal_conv(x[:, :cut], zero, weight, bias)
    rest, state = causal_conv(x[:, cut:], state, weight, bias)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(state, last, atol=0, rtol=0)
    padded = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=kernel - 1, groups=6)
    torch.testing.assert_close(whole.transpose(1, 2), padded[..., :12], atol=1e-12, rtol=0)
