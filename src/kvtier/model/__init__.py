"""Models: HF folder loading, the paged-attention decoder for Llama, Qwen2, Mistral, Gemma2 and
Gemma3 text, the tokenizer and incremental detokenizer, and the batched sampler.

One step (see tests/model/test_end_to_end.py):
    model = load_model(folder)                       # or load_pretrained(folder) for the tokenizer
    kv = model.allocate_kv_caches(num_blocks, block_size)   # per layer; groups = model.kv_groups
    meta = AttentionMetadata.build(num_computed, num_scheduled, block_ids[group][seq], block_size)
    hidden = model(input_ids, meta.query_positions(), kv, meta)
    logits = model.compute_logits(hidden, last_token_indices)
    out = sample(logits, SamplingBatch.from_params(params, positions, vocab_size), generator)
"""

from __future__ import annotations

from kvtier.model.arch import ArchSpec, arch_spec
from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.detokenizer import IncrementalDetokenizer
from kvtier.model.generation import GenerationDefaults, load_generation_defaults
from kvtier.model.loader import Pretrained, load_model, load_pretrained
from kvtier.model.sampler import SamplerOutput, SamplingBatch, sample
from kvtier.model.tokenizer import Tokenizer, load_tokenizer
from kvtier.model.transformer import CausalLM

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
