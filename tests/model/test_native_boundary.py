"""The native kernels' Python boundary (model/native.py): the C trusts every shape, stride and
dtype it is given, so each call checks its tensors with a ValueError that names the input — not
an assert, which `python -O` removes (one test runs the checks under -O)
(docs/architecture.md §Kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.model import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


def _k() -> native.Kernels:
    kernels = native.kernels()
    assert kernels is not None
    return kernels


def _attention(**change: object) -> None:
    """One decode over a one-block cache, with `change` replacing an input."""
    args: dict[str, object] = {
        "q": torch.zeros(1, 4, 64, dtype=BF16),
        "kv_cache": torch.zeros(2, 2, 16, 2, 64, dtype=BF16),
        "out": torch.zeros(1, 4, 64, dtype=BF16),
        "index": tuple(torch.tensor(v) for v in ([[0]], [0], [1], [0], [0], [1])),
    }
    args.update(change)
    _k().paged_attention(args["q"], args["kv_cache"], args["out"], args["index"], 0.125, None)  # type: ignore[arg-type]


def _index(**change: torch.Tensor) -> tuple[torch.Tensor, ...]:
    names = ("tables", "seq_token", "seq_qlen", "seq_row", "lo", "hi")
    base = dict(
        zip(names, (torch.tensor(v) for v in ([[0]], [0], [1], [0], [0], [1])), strict=True)
    )
    base.update(change)
    return tuple(base[n] for n in names)


def _linear(**change: object) -> None:
    kernels = _k()
    w = torch.randn(48, 64)
    args: dict[str, object] = {"x": torch.randn(3, 64), "n": 48, "bias": None}
    if kernels.f32_linear:
        args["packed"] = kernels.pack_linear(w)
    else:
        pytest.skip("no float32 linear here")
    args.update(change)
    kernels.linear_f32(args["x"], args["packed"], args["n"], args["bias"])  # type: ignore[arg-type]


def _bitmask(**change: object) -> None:
    args = {
        "logits": torch.zeros(2, 64),
        "mask": torch.zeros(2, 2, dtype=torch.int32),
        "rows": [0, 1],
    }
    args.update(change)
    _k().apply_bitmask(args["logits"], args["mask"], args["rows"])


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "attention q strided heads": (
        lambda: _attention(q=torch.zeros(1, 64, 4, dtype=BF16).transpose(1, 2)),
        "q's heads",
    ),
    "attention out strided": (
        lambda: _attention(out=torch.zeros(1, 4, 128, dtype=BF16)[..., :64]),
        "out must be",
    ),
    "attention cache of another dtype": (
        lambda: _attention(kv_cache=torch.zeros(2, 2, 16, 2, 64)),
        "kv_cache must be",
    ),
    "attention cache head_dim": (
        lambda: _attention(kv_cache=torch.zeros(2, 2, 16, 2, 32, dtype=BF16)),
        "kv_cache",
    ),
    "attention head_dim not a multiple of 16": (
        lambda: _attention(
            q=torch.zeros(1, 4, 40, dtype=BF16),
            out=torch.zeros(1, 4, 40, dtype=BF16),
            kv_cache=torch.zeros(2, 2, 16, 2, 40, dtype=BF16),
        ),
        "head_dim",
    ),
    "attention index int32": (
        lambda: _attention(index=_index(lo=torch.tensor([0], dtype=torch.int32))),
        "index lo",
    ),
    "attention index short": (lambda: _attention(index=_index()[:5]), "6 tensors"),
    "attention index lengths": (
        lambda: _attention(index=_index(seq_qlen=torch.tensor([1, 1]))),
        "index",
    ),
    "norm strided rows": (
        lambda: _k().rms_norm(torch.randn(4, 16, 2)[..., 0], torch.ones(16), 1e-6, False),
        "last dim",
    ),
    "norm too wide": (
        lambda: _k().rms_norm(torch.randn(2, 9000), torch.ones(9000), 1e-6, False),
        "8192",
    ),
    "norm weight dtype": (
        lambda: _k().rms_norm(torch.randn(2, 16), torch.ones(16, dtype=BF16), 1e-6, False),
        "weight must be",
    ),
    "norm weight size": (
        lambda: _k().rms_norm(torch.randn(2, 16), torch.ones(8), 1e-6, False),
        "16 elements",
    ),
    "norm residual shape": (
        lambda: _k().rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6, False, torch.zeros(3, 16)),
        "residual",
    ),
    "norm on float64": (
        lambda: _k().rms_norm(torch.randn(2, 16, dtype=torch.float64), torch.ones(16), 1e-6, False),
        "float32 or bfloat16",
    ),
    "rope strided heads": (
        lambda: _k().rope_(
            torch.randn(2, 16, 3).transpose(1, 2), torch.ones(2, 1, 16), torch.ones(2, 1, 16)
        ),
        "x's heads",
    ),
    "rope short tables": (
        lambda: _k().rope_(torch.randn(2, 3, 16), torch.ones(1, 1, 16), torch.ones(1, 1, 16)),
        "cos must be",
    ),
    "act_mul odd width": (lambda: _k().act_mul(torch.randn(2, 7), "silu"), r"\[rows, 2 \* inter\]"),
    "act_mul strided": (lambda: _k().act_mul(torch.randn(8, 2).t(), "silu"), "contiguous"),
    "act_mul activation": (lambda: _k().act_mul(torch.randn(2, 8), "relu"), "activation"),
    "pack float64": (lambda: _k().pack_linear(torch.randn(4, 4, dtype=torch.float64)), "weight"),
    "linear wrong packed size": (lambda: _linear(n=64), "pack_linear"),
    "linear x of another k": (lambda: _linear(x=torch.randn(3, 32)), "packed has"),
    "linear bias size": (lambda: _linear(bias=torch.zeros(47)), "bias"),
    "bitmask logits float16": (
        lambda: _bitmask(logits=torch.zeros(2, 64, dtype=torch.float16)),
        "logits must be float32 or bfloat16",
    ),
    "bitmask logits strided": (
        lambda: _bitmask(logits=torch.zeros(64, 2).t()),
        "logits must be",
    ),
    "bitmask mask int64": (
        lambda: _bitmask(mask=torch.zeros(2, 2, dtype=torch.int64)),
        "mask must be",
    ),
    "bitmask mask rows": (
        lambda: _bitmask(mask=torch.zeros(3, 2, dtype=torch.int32)),
        r"mask must be \[2, words\]",
    ),
    "bitmask row out of range": (lambda: _bitmask(rows=[0, 2]), r"\[0, 2\)"),
    "bitmask row negative": (lambda: _bitmask(rows=[-1]), r"\[0, 2\)"),
    "top_k per row": (
        lambda: native.top_k_top_p_(torch.randn(3, 100), torch.tensor([1, 2]), None),
        "top_k",
    ),
    "draw u per row": (lambda: native.draw(torch.randn(3, 100), torch.rand(2)), "u must have"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_a_value_error_naming_it(case: str) -> None:
    call, words = CASES[case]
    with pytest.raises(ValueError, match=words):
        call()


OPTIMIZED = """
import sys, torch
from kvtier.model import native
assert sys.flags.optimize == 1
kernels = native.kernels()
try:
    kernels.rms_norm(torch.randn(4, 16, 2)[..., 0], torch.ones(16), 1e-6, False)
except ValueError as exc:
    print("raised:", exc)
try:
    kernels.apply_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])
except ValueError as exc:
    print("raised:", exc)
"""


def test_the_checks_hold_under_python_dash_o() -> None:
    """`python -O` strips asserts; the boundary's checks must still raise there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-O", "-c", OPTIMIZED], env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "raised: x's last dim must be contiguous" in res.stdout, res.stdout
    assert "raised: rows must be in [0, 2)" in res.stdout, res.stdout
