"""The fused elementwise kernels of model/native.py against the torch ops they replace: RMSNorm
(Llama and Gemma, with the residual add before it, on strided per-head rows), rotary embedding in
place, act(gate) * up. They round where the torch ops round, so float32 rope is bit for bit and
bfloat16 differs at most in the last bit, rarely (a transcendental's last float32 bit, or the
order of a sum)."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import native
from kvtier.model.layers import GatedMLP, RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(ours: torch.Tensor, torch_ops: torch.Tensor, min_equal: float = 0.0) -> None:
    """Within a few units in the last place of the dtype (and 1e-6 of the largest value, for
    results of cancellation near zero); in bfloat16 most elements equal (`min_equal`)."""
    assert ours.dtype == torch_ops.dtype and ours.shape == torch_ops.shape
    ulps = 8 if ours.dtype == torch.float32 else 1
    ours, torch_ops = ours.detach(), torch_ops.detach()
    atol = 1e-6 * float(torch_ops.abs().max())
    torch.testing.assert_close(ours, torch_ops, rtol=ulps * torch.finfo(ours.dtype).eps, atol=atol)
    if ours.dtype == torch.bfloat16:
        assert (ours == torch_ops).float().mean() >= min_equal


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_with_and_without_the_residual_add(dtype, gemma):
    ours = RMSNorm(200, 1e-6, gemma).to(dtype)
    ref = RMSNorm(200, 1e-6, gemma, native=False).to(dtype)
    weight = torch.randn(200, generator=gen(1)) * 0.3 + (0.0 if gemma else 1.0)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    x = (torch.randn(37, 200, generator=gen(2)) * 3).to(dtype)
    res = torch.randn(37, 200, generator=gen(3)).to(dtype)
    assert_matches(ours(x), ref(x), 0.97)
    residual = res.clone()
    normed, summed = ours.forward_add(x, residual)
    ref_normed, ref_summed = ref.forward_add(x, res)
    assert summed is residual  # updated in place
    assert torch.equal(summed, ref_summed)
    assert_matches(normed, ref_normed, 0.97)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_of_strided_head_rows(dtype):
    """Gemma3's q_norm runs on q [T, H, D], a view of the fused projection's rows."""
    qkv = torch.randn(9, 7 * 32, generator=gen(4)).to(dtype)
    q = qkv[:, : 4 * 32].view(9, 4, 32)
    ours, ref = RMSNorm(32, 1e-6, True).to(dtype), RMSNorm(32, 1e-6, True, native=False).to(dtype)
    ours.weight.data.normal_(generator=gen(5))
    ref.weight.data.copy_(ours.weight.data)
    out = ours(q)
    assert out.is_contiguous() and out.shape == (9, 4, 32)
    assert_matches(out, ref(q), 0.97)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 32, 40])  # 40: half a head is no whole 16-lane vector
def test_rope_in_place_is_bit_for_bit(dtype, dim):
    qkv = torch.randn(11, 8 * dim, generator=gen(6)).to(dtype)
    angles = torch.randn(11, 1, dim // 2, generator=gen(7)) * 5
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    v_before = qkv[:, 6 * dim :].clone()
    qk = qkv[:, : 6 * dim].view(11, 6, dim)  # q and k heads of a fused projection
    expected = apply_rope(qk, cos, sin, native=False)
    out = apply_rope(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # rotated where it lies
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, 6 * dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_act_mul_matches_torch(dtype, activation):
    mlp = GatedMLP(48, 2100, activation, bias=False).to(dtype)  # 2100 > one 2048 buffer
    gate_up = (torch.randn(5, 4200, generator=gen(8)) * 4).to(dtype)
    kernels = native.kernels()
    assert kernels is not None
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    else:
        act = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
    assert_matches(kernels.act_mul(gate_up, activation), act * up, 0.99)
    x = torch.randn(5, 48, generator=gen(9)).to(dtype)
    torch_mlp = GatedMLP(48, 2100, activation, bias=False, native=False).to(dtype)
    torch_mlp.load_state_dict(mlp.state_dict())
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(mlp(x), torch_mlp(x), rtol=tol, atol=tol)


SPECIAL = [float("nan"), float("inf"), float("-inf"), 100.0, -100.0, 88.0, -88.0, 89.0, -90.0,
           1e-30, -1e-30, 0.0, -0.0, 3.0, -3.0, 10.0, -10.0, -4.5, -5.0]  # fmt: skip


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_mul_special_values_are_torch_s(activation):
    """NaN, infinities, overflow and underflow of the exponential, signed zeros, the region where
    1 + tanh cancels: the same bfloat16 as torch's ops."""
    gate = torch.tensor(SPECIAL * 2, dtype=torch.bfloat16)  # 38: two vectors and a tail
    up = torch.linspace(-2, 2, gate.numel()).to(torch.bfloat16)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    kernels = native.kernels()
    assert kernels is not None
    ours = kernels.act_mul(torch.cat([gate, up])[None], activation)[0]
    torch.testing.assert_close(ours, act * up, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds the x86-64 baseline ISA")
def test_portable_build_of_the_elementwise_kernels_agrees():
    """fused.c built without AVX-512 (its loops through float32 buffers) gives what the vector
    build gives — both within a bfloat16 ulp of torch — for act * up and the norms, and rope's
    bits."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    portable = native.build("x86-64")
    vector = native.kernels()
    assert portable is not None, "the portable build failed (its log says why)"
    assert vector is not None
    gate_up = (torch.randn(7, 2 * 600, generator=gen(11)) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    for activation, act in (
        ("silu", F.silu(gate)),
        ("gelu_tanh", F.gelu(gate, approximate="tanh")),
    ):
        ours = [k.act_mul(gate_up, activation) for k in (portable, vector)]
        assert (ours[0] == ours[1]).float().mean() >= 0.99
        for out in ours:
            assert_matches(out, act * up, 0.99)
    x = (torch.randn(37, 200, generator=gen(12)) * 3).to(torch.bfloat16)
    weight = (torch.randn(200, generator=gen(13)) * 0.3).to(torch.bfloat16)
    for gemma in (False, True):
        ref = RMSNorm(200, 1e-6, gemma, native=False).to(torch.bfloat16)
        ref.weight.data.copy_(weight)
        residual = torch.randn(37, 200, generator=gen(14)).to(torch.bfloat16)
        ref_normed, ref_summed = ref.forward_add(x, residual.clone())
        for k in (portable, vector):
            summed = residual.clone()
            normed = k.rms_norm(x, weight, 1e-6, gemma, summed)
            assert torch.equal(summed, ref_summed)
            assert_matches(normed, ref_normed, 0.97)
            assert_matches(k.rms_norm(x, weight, 1e-6, gemma), ref(x), 0.97)
    angles = torch.randn(5, 1, 16, generator=gen(15)) * 5
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    heads = (torch.randn(5, 3, 32, generator=gen(16)) * 2).to(torch.bfloat16)
    expected = apply_rope(heads, cos, sin, native=False)
    for k in (portable, vector):
        assert torch.equal(k.rope_(heads.clone(), cos, sin), expected)


def test_kernels_stay_off_where_they_cannot_serve():
    """float64 (the goldens' truth) and non-contiguous tables take the torch ops."""
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    cos, sin = torch.ones(3, 1, 16, dtype=torch.float64), torch.zeros(3, 1, 16, dtype=torch.float64)
    assert not native.usable(x)
    out = apply_rope(x, cos, sin)
    assert out.data_ptr() != x.data_ptr() and torch.equal(out, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_with_ties_nan_and_infinities(dtype):
    x = torch.randn(9, 1003, generator=gen(10)).to(dtype)  # not a multiple of 16
    x[1, [5, 900]] = 50.0  # a tie: the first
    x[2, [17, 500]] = float("nan")  # NaN wins, the first one
    x[3] = float("-inf")
    x[4, 1002] = float("inf")
    x[5] = 0.0
    x[6, 999:] = 80.0  # the maximum in the tail past the last full vector
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))
    rows = x[:, :1000]  # strided rows
    assert torch.equal(native.argmax(rows), rows.argmax(dim=-1))
    assert native.argmax(x).tolist()[1:7] == [5, 17, 0, 1002, 0, 999]


def test_no_writable_kernel_cache_means_the_torch_paths(tmp_path, monkeypatch):
    """A cache directory that cannot be created is a logged fallback, not a failed forward."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a directory must go
    assert native.build() is None
