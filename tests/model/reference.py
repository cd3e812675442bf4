"""`transformers` references for the goldens: eager attention, plus a chunked-local variant of
Llama (HF's Llama has no chunked layers) that adds Llama-4's chunk mask in a registered attention
function on the layers `config.py` marks chunked."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvtier.model.hf_config import load_model_config, model_config_from_dict

CHUNKED_EAGER = "kvtier_chunked_eager"


def _chunked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's eager attention with our own mask: causal, plus Llama-4's chunks on chunked layers
    (HF builds no mask for a custom attention name; batches here have no padding)."""
    kinds = model_config_from_dict(module.config.to_dict()).layer_kinds
    num_q, num_k = query.shape[-2], key.shape[-2]
    k_pos = torch.arange(num_k)
    q_pos = k_pos[num_k - num_q :]
    allowed = k_pos[None] <= q_pos[:, None]
    if kinds[module.layer_idx] == "chunked":
        chunk = module.config.attention_chunk_size
        allowed &= k_pos[None] // chunk == q_pos[:, None] // chunk
    mask = torch.zeros(num_q, num_k, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return eager_attention_forward(module, query, key, value, mask[None, None], scaling, dropout)


AttentionInterface.register(CHUNKED_EAGER, _chunked_eager)


def hf_model(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    cfg = load_model_config(folder)
    attn = CHUNKED_EAGER if "chunked" in cfg.layer_kinds else "eager"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn)
    return model.eval()


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of one full forward (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]
