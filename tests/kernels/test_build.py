"""The kernels' build (kvtier/kernels/build.py): a portable ISA besides `native`, `$CC` and
`$CFLAGS` taken as `make` takes them, one library cached per ISA and sources, a bad ISA refused
by name (docs/architecture.md §Kernels)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.kernels import build
from tests.torch_blocked import run_without_torch

ROOT = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="builds x86-64 ISAs")

PORTABLE_SCRIPT = """
import torch
from kvtier.model import native
from kvtier.model.layers import RMSNorm

kernels = native.kernels()
assert kernels is not None, "the portable build failed"
assert kernels.path.name.startswith("kvtier-x86-64-v3-"), kernels.path
assert kernels.tile_linear == "avx2" and kernels.f32_linear  # the AVX2 paths, no AVX-512 in v3
assert not kernels.attention_tiles()
gen = torch.Generator().manual_seed(0)
x = torch.randn(37, 200, generator=gen).bfloat16()
weight = torch.randn(200, generator=gen).bfloat16()
ref = RMSNorm(200, 1e-6, False, native=False).to(torch.bfloat16)
ref.weight.data.copy_(weight)
same = (kernels.rms_norm(x, weight, 1e-6, False) == ref(x)).float().mean().item()
assert same > 0.97, same
logits = torch.randn(5, 1000, generator=gen)
assert torch.equal(native.argmax(logits), logits.argmax(dim=-1))
# the top-p filter's whole row on the portable loops: its cut is the float64 sort's (one float32
# sum over the row moved a cut at 0.999 by a hundred tokens)
from kvtier.model.sampler import _sorted_filter
x = torch.randn(3, 32000, generator=gen) * 3.0
top_p = torch.tensor([0.9, 0.99, 0.999])
ours = native.top_k_top_p_(x.clone(), None, top_p)
want = _sorted_filter(x.double(), None, top_p.double())
assert torch.equal(torch.isfinite(ours), torch.isfinite(want))
# the AVX2 tiles: VDPBF16PS's in-order sums (the odd product of each pair, then the even one)
w = torch.randn(40, 100, generator=gen).bfloat16()
x = torch.randn(7, 100, generator=gen).bfloat16()
acc = torch.zeros(7, 40)
for k in range(0, 100, 2):
    acc = acc + x[:, k + 1, None].float() * w[None, :, k + 1].float()
    acc = acc + x[:, k, None].float() * w[None, :, k].float()
assert torch.equal(kernels.linear_bf16(x, kernels.pack_linear(w), 40, None), acc.bfloat16())
# the AVX2 int8 linear: the int16 blocks' bits (AVX512-VNNI's), here at any row count
from kvtier.model.quant import quantize_int8
from tests.model.int8_reference import linear_i8_bits
q, scale = quantize_int8(torch.randn(40, 100, generator=gen))
assert kernels.i8_linear == "avx2"
assert torch.equal(kernels.linear_i8(x, kernels.pack_linear_i8(q), scale, 40, None),
                   linear_i8_bits(x, q, scale, None))
# the AVX2 float32 linear: a row's bits alone are its bits in a batch
w = torch.randn(40, 100, generator=gen)
x = torch.randn(9, 100, generator=gen)
packed = kernels.pack_linear(w)
whole = kernels.linear_f32(x, packed, 40, None)
assert all(torch.equal(kernels.linear_f32(x[:m], packed, 40, None), whole[:m]) for m in (1, 2, 7))
torch.testing.assert_close(whole, x @ w.T)
print("portable ok")
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # kvtier, and tests' references
    env = {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(tmp_path)}
    return {**env, **extra}


@needs_cc
@x86
def test_a_portable_build_runs_the_kernels_with_cc_as_a_command_and_its_arguments(tmp_path):
    """KVTIER_CPU_ISA=x86-64-v3 builds the library without its AVX-512 paths and the model's
    kernels run on it; CC="env cc" is a command with an argument, as `make` takes it (it
    counted as no compiler when CC was looked up as one file name)."""
    env = _env(tmp_path, KVTIER_CPU_ISA="x86-64-v3", CC="env cc")
    res = subprocess.run([sys.executable, "-c", PORTABLE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "portable ok" in res.stdout
    assert [p.name.split("-")[:3] for p in (tmp_path / "kvtier" / "kernels").glob("*.so")] == [
        ["kvtier", "x86", "64"]
    ]


@needs_cc
@x86
def test_cflags_reach_every_compile(tmp_path, monkeypatch, caplog):
    """$CFLAGS go to the compiler after ours: a flag it rejects fails the build (logged, None)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CFLAGS", "-fno-such-flag-kvtier")
    with caplog.at_level("WARNING", logger="kvtier.kernels"):
        assert build.build("x86-64-v3") is None
    assert "-fno-such-flag-kvtier" in caplog.text


@needs_cc
@x86
def test_builds_are_cached_per_isa_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CFLAGS", raising=False)
    first = build.build("x86-64-v3")
    assert first is not None
    stamp = first.stat().st_mtime_ns
    assert build.build("x86-64-v3") == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("CFLAGS", "-O2")
    other = build.build("x86-64-v3")
    assert other is not None and other != first


def test_an_isa_that_is_no_march_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "native -fplugin=x.so")
    with pytest.raises(ValueError, match="KVTIER_CPU_ISA"):
        build.isa()
    monkeypatch.setenv(build.ISA_ENV, "")
    assert build.isa() == "native"


def test_no_compiler_is_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc") + " --flag")
    assert build.build() is None


TORCH_FREE = """
from kvtier.kernels import abi, build
path = build.build()
if path is not None:
    library = abi.load(path)
    assert library.kvtier_abi_fields(b"Step") == len(abi.Step._fields_)
print("ok", path is not None)
"""


def test_the_kernels_package_builds_and_loads_with_torch_blocked():
    """kvtier.kernels knows C and ctypes only; the tensors are model/native.py's."""
    assert run_without_torch(TORCH_FREE).startswith("ok ")


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86-64 Linux"
)
def test_cpu_flags_are_the_words_of_cpuinfos_flags_line() -> None:
    flags = build.cpu_flags()
    assert "sse2" in flags and "flags" not in flags and ":" not in flags
    assert all(f in build.cpu_signature() for f in flags)
