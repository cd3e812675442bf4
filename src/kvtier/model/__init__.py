"""Models: HF folder loading, the paged-attention decoder for Llama, Qwen2, Mistral, Gemma2 and
Gemma3 text, the tokenizer and incremental detokenizer, and the batched sampler.

One step (see tests/model/test_end_to_end.py):
    model = load_model(folder)                       # or load_pretrained(folder) for the tokenizer
    kv = model.allocate_kv_caches(num_blocks, block_size)   # per layer; groups = model.kv_groups
    meta = AttentionMetadata.build(num_computed, num_scheduled, block_ids[group][seq], block_size)
    hidden = model(input_ids, meta.query_positions(), kv, meta)
    logits = model.compute_logits(hidden, last_token_indices)
    out = sample(logits, SamplingBatch.from_params(params, positions, vocab_size), generator)

Names load on first use, so that the torch-free readers (`hf_config.py`, `arch.py`) import
without torch: `kvtier plan` reads a model's `config.json` through them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.model.arch import ArchSpec, arch_spec
    from kvtier.model.attention import AttentionMetadata, LayerKind
    from kvtier.model.detokenizer import IncrementalDetokenizer
    from kvtier.model.generation import GenerationDefaults, load_generation_defaults
    from kvtier.model.loader import Pretrained, load_model, load_pretrained
    from kvtier.model.sampler import SamplerOutput, SamplingBatch, sample
    from kvtier.model.tokenizer import Tokenizer, load_tokenizer
    from kvtier.model.transformer import CausalLM

_HOMES = {
    "ArchSpec": "arch",
    "arch_spec": "arch",
    "AttentionMetadata": "attention",
    "LayerKind": "attention",
    "IncrementalDetokenizer": "detokenizer",
    "GenerationDefaults": "generation",
    "load_generation_defaults": "generation",
    "Pretrained": "loader",
    "load_model": "loader",
    "load_pretrained": "loader",
    "SamplerOutput": "sampler",
    "SamplingBatch": "sampler",
    "sample": "sampler",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "CausalLM": "transformer",
}

__all__ = [
    "ArchSpec",
    "AttentionMetadata",
    "CausalLM",
    "GenerationDefaults",
    "IncrementalDetokenizer",
    "LayerKind",
    "Pretrained",
    "SamplerOutput",
    "SamplingBatch",
    "Tokenizer",
    "arch_spec",
    "load_generation_defaults",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "sample",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'kvtier.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtier.model.{_HOMES[name]}"), name)
