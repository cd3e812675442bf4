"""The models a benchmark names: built-in ones generated on the fly with random weights (a tiny Llama,
a Qwen2 with the shape of a 0.5B-parameter model), the embedded default model, or a local folder;
and the short label a benchmark prints and names its files by."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

TINY_LLAMA = "tiny-llama"
QWEN2_05B = "qwen2-0.5b-shape"
DEFAULT = "default"
W8A8 = "-w8a8"  # a built-in name's suffix: that model as a compressed-tensors W8A8 checkpoint
BUILTIN = (TINY_LLAMA, QWEN2_05B, DEFAULT, TINY_LLAMA + W8A8, QWEN2_05B + W8A8)
HELP = (
    f"{TINY_LLAMA} (hidden 256, 4 layers, vocab 1024), {QWEN2_05B} (Qwen2-0.5B's shape: hidden "
    f"896, 24 layers, 14/2 heads, intermediate 4864, vocab 32000, tied; random bf16 weights), "
    f"{DEFAULT} (the embedded Gemma3), {TINY_LLAMA}{W8A8} and {QWEN2_05B}{W8A8} (those written as "
    "compressed-tensors W8A8 checkpoints: int8 weights, int8 activations per token, the LM head "
    "bf16, as vLLM and kvtier both load them), or model folders"
)


def model_path(name: str, tmp: Path) -> Path:
    """The folder of model `name`, writing a built-in one under `tmp` (a path is returned as is)."""
    from kvtier.model import testing

    if name in (TINY_LLAMA + W8A8, QWEN2_05B + W8A8):
        from kvtier.model.quant import W8A8_ACTIVATIONS

        source = model_path(name.removesuffix(W8A8), tmp)
        return testing.write_int8_model(source, tmp / name, activations=dict(W8A8_ACTIVATIONS))
    if name == TINY_LLAMA:
        return testing.write_tiny_model(
            tmp / name, "llama", hidden_size=256, num_layers=4, vocab_size=1024
        )
    if name == QWEN2_05B:
        return testing.write_tiny_model(tmp / name, "qwen2", 0, **QWEN2_05B_SHAPE)
    if name == DEFAULT:
        from kvtier.engine.params import DEFAULT_MODEL

        return Path(DEFAULT_MODEL)
    return Path(name)


QWEN2_05B_SHAPE: dict[str, Any] = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 32000,
    "window": None,  # Qwen2-0.5B attends fully on every layer
    "dtype": "bfloat16",
}


def label(name: str) -> str:
    """A built-in name, or a folder's own name: safe in a file name and short in a table."""
    if name in BUILTIN:
        return name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or "model")
