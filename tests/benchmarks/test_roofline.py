"""`python -m benchmarks.roofline` (`kvtier bench roofline`) at toy size: the bytes a decode step
reads (weights once, each sequence's KV over its readable context), a measured copy bandwidth,
and one row per batch size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import main, roofline
from kvtier.model.loader import load_model
from kvtier.model.testing import write_tiny_model


def test_roofline_rows_per_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bounds' measurements are replaced by fixed numbers, so what the run does with them
    # does not depend on how loaded this machine is (the real ones: the test below).
    samples: list[float] = []
    copies: list[float] = []

    def rising(dtype: torch.dtype) -> float:  # the box got faster between the two measurements
        samples.append(1e9 * (1 + len(samples)))
        return samples[-1]

    def falling(mib: int) -> float:  # and its memory slower
        copies.append(2e10 / (1 + len(copies)))
        return copies[-1]

    monkeypatch.setattr(roofline, "matmul_rate", rising)
    monkeypatch.setattr(roofline, "copy_bandwidth", falling)
    out = tmp_path / "rl.json"
    rc = main(
        roofline,
        [
            "--model", "tiny-llama", "--batch-sizes", "1", "3",
            "--input-len", "8", "--output-len", "3", "--rounds", "1", "--copy-mib", "8",
            "--threads", "2", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["copy_bandwidth_bytes_s"] > 0
    # the copy and every engine's decode steps ran on the threads asked for
    assert res["threads"] == 2 and all(r["torch_threads"] == 2 for r in res["rows"])
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    one, three = res["rows"]
    assert one["weight_bytes"] == three["weight_bytes"] > 0
    assert three["kv_bytes"] == 3 * one["kv_bytes"] > 0
    assert all(r["fraction_of_roofline"] > 0 for r in res["rows"])
    # the compute bound: 3 rows take 3 times one row's multiply-adds at the measured rate
    assert res["matmul_macs_s"] > 0
    assert three["compute_ms"] == pytest.approx(3 * one["compute_ms"]) and one["compute_ms"] > 0
    # each bound is the best of one measurement before each batch size, the same for every row
    assert res["matmul_macs_s_samples"] == samples and len(samples) == 2
    assert res["matmul_macs_s"] == samples[1] > samples[0]
    assert one["compute_ms"] == pytest.approx(one["macs"] / samples[1] * 1e3)
    assert res["copy_bandwidth_samples"] == copies and len(copies) == 2
    assert res["copy_bandwidth_bytes_s"] == copies[0] > copies[1]
    bytes_one = one["weight_bytes"] + one["kv_bytes"]
    assert one["roofline_ms"] == pytest.approx(bytes_one / copies[0] * 1e3)
    for r in res["rows"]:
        higher = max(r["roofline_ms"], r["compute_ms"])
        assert abs(r["fraction_of_bound"] - higher / r["step_ms"]) < 1e-9
        # the linears alone: every weight the step multiplies, the tied LM head once, so their
        # bytes are the step's weights less the norms' vectors; timed, and the rest is the step's
        assert 0.9 * r["weight_bytes"] < r["linear_bytes"] < r["weight_bytes"]
        assert r["linear_ms"] > 0 and len(r["linear_ms_rounds"]) == len(r["step_ms_rounds"]) == 1
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - r["linear_ms"])
        bound = r["linear_bytes"] / res["copy_bandwidth_bytes_s"] * 1e3
        assert r["linear_roofline_ms"] == pytest.approx(bound)
        assert r["linear_fraction_of_roofline"] == pytest.approx(bound / r["linear_ms"])


def test_bound_measurements_are_positive_rates() -> None:
    assert roofline.copy_bandwidth(4, repeats=1) > 0
    assert roofline.matmul_rate(torch.bfloat16, repeats=1) > 0


def test_bounds_from_one_row_s_timings() -> None:
    row = {"step_ms": 50.0, "linear_ms": 40.0, "weight_bytes": 900, "kv_bytes": 100,
           "linear_bytes": 800, "macs": 2e6}  # fmt: skip
    out = roofline.with_bounds(row, bandwidth=1e5, rate=1e8)  # bytes/s, multiply-adds/s
    assert out["roofline_ms"] == pytest.approx(10.0) and out["compute_ms"] == pytest.approx(20.0)
    assert out["fraction_of_roofline"] == pytest.approx(0.2)
    assert out["fraction_of_bound"] == pytest.approx(0.4)  # the compute bound is the higher
    assert out["linear_roofline_ms"] == pytest.approx(8.0)
    assert out["linear_fraction_of_roofline"] == pytest.approx(0.2)
    assert out.items() >= row.items()
    # W8A8 linears' multiply-adds count at their own rate
    w8a8 = roofline.with_bounds(row | {"w8a8_macs": 1e6}, bandwidth=1e5, rate=1e8, int8_rate=2e8)
    assert w8a8["compute_ms"] == pytest.approx(15.0)
    with pytest.raises(ValueError, match="W8A8 kernel's rate"):
        roofline.with_bounds(row | {"w8a8_macs": 1e6}, bandwidth=1e5, rate=1e8)


def test_the_w8a8_rate_is_a_positive_rate() -> None:
    assert roofline.w8a8_rate(repeats=1) > 0


def test_a_w8a8_row_counts_its_int8_linears_at_the_w8a8_rate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(roofline, "w8a8_rate", lambda: 4e9)
    monkeypatch.setattr(roofline, "matmul_rate", lambda dtype: 1e9)
    out = tmp_path / "rl.json"
    rc = main(roofline, ["--model", "tiny-llama", "--batch-sizes", "2", "--weights", "bfloat16",
                         "w8a8", "--input-len", "8", "--output-len", "3", "--rounds", "1",
                         "--copy-mib", "8", "--out", str(out)])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    base, w8a8 = res["rows"]
    assert base["weights"] == "bfloat16" and base["w8a8_macs"] == 0
    assert w8a8["weights"] == "w8a8" and 0 < w8a8["w8a8_macs"] < w8a8["macs"]
    rest = w8a8["macs"] - w8a8["w8a8_macs"]
    assert w8a8["compute_ms"] == pytest.approx((rest / 1e9 + w8a8["w8a8_macs"] / 4e9) * 1e3)
    assert res["w8a8_macs_s"] == 4e9


def test_linears_are_every_weight_once_and_a_pass_runs_them_all(tmp_path: Path) -> None:
    qwen = load_model(write_tiny_model(tmp_path / "q", "qwen2", window=4), dtype="bfloat16")
    layers = roofline.linears(qwen)
    cfg = qwen.config  # q, k, v, o, gate, up, down a layer (or fused) and the tied LM head
    weights = {id(m.weight) for m in layers}
    assert len(weights) == len(layers)
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert id(qwen.lm_head.weight) in weights
    per_layer = sum(m.weight.numel() for m in layers if m is not qwen.lm_head) // cfg.num_layers
    h, inter = cfg.hidden_size, cfg.hf_config["intermediate_size"]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert per_layer == h * (q + 2 * kv) + q * h + 3 * h * inter
    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: calls.append(o.shape[0])) for m in layers]
    assert roofline.linear_pass_s(layers, 3, torch.bfloat16, repeats=2) > 0
    for hook in hooks:
        hook.remove()
    assert calls == [3] * 3 * len(layers)  # a warm-up pass and two timed, 3 rows each


def test_bytes_per_step_count_tied_weights_once_and_windows(tmp_path: Path) -> None:
    qwen = load_model(write_tiny_model(tmp_path / "q", "qwen2", window=4), dtype="bfloat16")
    params = {id(p): p for p in qwen.parameters()}.values()  # the LM head is the embedding
    assert roofline.weight_bytes(qwen, tied=True) == sum(2 * p.numel() for p in params)
    cfg = qwen.config  # Qwen2 slides from layer max_window_layers = 1 on: 1 full, 3 over 4 tokens
    assert cfg.layer_kinds == ("full", "sliding", "sliding", "sliding")
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert roofline.kv_bytes(qwen, 2, 10.0, 2) == 2 * (1 * 10 + 3 * 4) * per_token
    assert roofline.kv_bytes(qwen, 2, 10.0, 1) * 2 == roofline.kv_bytes(qwen, 2, 10.0, 2)  # fp8
    # a step's multiply-adds: every weight element per row, KV elements per query head
    weights, kv = (
        roofline.weight_bytes(qwen, True, elements=True),
        roofline.kv_bytes(qwen, 2, 10.0, 2),
    )
    assert weights == sum(p.numel() for p in params)
    heads = cfg.num_heads // cfg.num_kv_heads
    assert roofline.step_macs(qwen, 2, weights, kv, 2) == 2 * weights + kv / 2 * heads
    kv8 = roofline.kv_bytes(qwen, 2, 10.0, 1)  # an 8-bit KV: the same multiply-adds
    assert roofline.step_macs(qwen, 2, weights, kv8, 1) == roofline.step_macs(
        qwen, 2, weights, kv, 2
    )


def test_int8_weights_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--weights`: each batch size runs every format, int8 reading about half the bytes; the
    int8-all head is an int8 copy of the tied table, which is then only indexed."""
    monkeypatch.setattr(roofline, "matmul_rate", lambda dtype: 1e9)
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda mib: 1e10)
    out = tmp_path / "rl.json"
    args = ["--model", "tiny-llama", "--batch-sizes", "1", "2", "--input-len", "8",
            "--output-len", "3", "--rounds", "1", "--threads", "1", "--out", str(out),
            "--weights", "bfloat16", "int8", "int8-all"]  # fmt: skip
    assert main(roofline, args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["weights"]) for r in rows] == [
        (b, w) for b in (1, 2) for w in ("bfloat16", "int8", "int8-all")
    ]
    by = {(r["batch"], r["weights"]): r for r in rows}
    bf16, int8, every = by[1, "bfloat16"], by[1, "int8"], by[1, "int8-all"]
    assert bf16["speedup"] == 1.0 and int8["speedup"] > 0
    assert int8["speedup"] == pytest.approx(int8["output_tok_s"] / bf16["output_tok_s"])
    assert 0.5 * bf16["linear_bytes"] < int8["linear_bytes"] < 0.7 * bf16["linear_bytes"]
    assert every["weight_bytes"] < int8["weight_bytes"] < bf16["weight_bytes"]
    assert every["macs"] == pytest.approx(bf16["macs"], rel=1e-2)  # the same products (+ scales)
