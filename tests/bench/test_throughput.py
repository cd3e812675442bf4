"""`kvtier bench throughput` end to end at toy size: every prompt gets its tokens, the JSON
carries the cold and warm passes, and the prompts are the seeded random ids bench compare uses."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench.throughput import random_prompts
from kvtier.cli import main


def test_throughput_counts_every_output_token(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(
        [
            "bench", "throughput", "--models", "default", "--dtypes", "float32",
            "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
            "--no-transformers", "--torch-threads", "2", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    saved = json.loads(out.read_text())
    assert saved["threads"] == 2
    [row] = saved["rows"]
    for run in ("cold", "warm"):
        assert row["kvtier"][run]["output_tokens"] == 4 * 8
        assert row["kvtier"][run]["output_tokens_per_s"] > 0
        assert row["kvtier"][run]["cores"] > 0


def test_random_prompts_are_seeded_and_skip_special_ids() -> None:
    a = random_prompts(1, 3, 5, 10)
    assert a == random_prompts(1, 3, 5, 10) and a != random_prompts(2, 3, 5, 10)
    assert [len(p) for p in a] == [5, 5, 5]
    assert all(3 <= t < 10 for p in a for t in p)


def test_protect_cost_runs_all_beside_none_with_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(
        [
            "bench", "throughput", "--models", "default", "--dtypes", "float32",
            "--num-prompts", "3", "--input-len", "12", "--output-len", "6",
            "--no-transformers", "--protect-cost", "2", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    [row] = json.loads(out.read_text())["rows"]
    cost = row["protect_cost"]
    assert cost["same_tokens"] is True and len(cost["rounds"]) == 2
    for r in cost["rounds"]:
        assert r["all"]["output_tokens"] == r["none"]["output_tokens"] == 3 * 6
    assert {"cost_tok_s", "cost_cpu_s"} <= set(cost)


def test_qwen2_05b_shape_is_the_shape_of_qwen2_05b() -> None:
    """The built-in shape (its config only: the weights are 1 GB) has Qwen2-0.5B's dimensions
    and, with a 32k vocabulary, about 0.4B parameters, every layer attending fully."""
    from kvtier.bench import models
    from kvtier.model.arch import arch_spec
    from kvtier.model.hf_config import model_config_from_dict
    from kvtier.model.testing import tiny_config

    cfg = model_config_from_dict(tiny_config("qwen2", **models.QWEN2_05B_SHAPE))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (896, 24, 14, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.dtype) == (64, 32000, "bfloat16")
    assert set(cfg.layer_kinds) == {"full"}
    spec = arch_spec(cfg)
    assert spec.intermediate_size == 4864 and spec.tie_word_embeddings and spec.qkv_bias
    per_layer = 896 * (896 + 2 * 128) + 896 * 896 + 3 * 896 * 4864
    assert 0.38e9 < 24 * per_layer + 32000 * 896 < 0.40e9


def test_model_labels_are_file_names() -> None:
    from kvtier.bench import models

    assert models.label("tiny-llama") == "tiny-llama"
    assert models.label("/data/models/Qwen2.5 0.5B/") == "Qwen2.5_0.5B"


def test_a_w8a8_builtin_is_the_model_as_a_w8a8_checkpoint(tmp_path: Path) -> None:
    from kvtier.bench import models
    from kvtier.model.loader import load_model
    from kvtier.model.quant import Int8Linear

    folder = models.model_path("tiny-llama-w8a8", tmp_path)
    assert models.label("tiny-llama-w8a8") == "tiny-llama-w8a8"
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert groups["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    lin = load_model(folder, dtype="bfloat16").model.layers[0].mlp.down_proj
    assert isinstance(lin, Int8Linear) and lin.int8_activations


def test_profile_writes_the_functions_by_own_time(tmp_path: Path) -> None:
    prof = tmp_path / "profile.txt"
    rc = main(
        [
            "bench", "throughput", "--models", "default", "--dtypes", "float32",
            "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--no-transformers",
            "--profile", str(prof), "--out", str(tmp_path / "tp.json"),
        ]
    )  # fmt: skip
    assert rc == 0
    text = prof.read_text()
    assert text.startswith("== default float32") and "Ordered by: internal time" in text
    assert "transformer.py" in text  # the forward ran under the profiler, on the host thread
