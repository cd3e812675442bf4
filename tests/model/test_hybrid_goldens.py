"""Goldens of the Mamba2 hybrids (Falcon-H1, Granite 4.0 hybrid) against `transformers`' torch path
on tiny local models: chunked prefill then 32 greedy decode steps on the paged KV and block-addressed
Mamba states (block size 4, so states move to a new block every 4 tokens; freed and fresh blocks are
NaN), compared position by position with one full HF forward."""

from __future__ import annotations

import pytest
import torch

from kvtier.model.hybrid_loader import load_hybrid
from kvtier.model.testing import HYBRID_ARCHITECTURES
from tests.model.hybrid_paged import HybridKV
from tests.model.reference import hf_logits, hf_model

# Measured max |Δlogit| (logit std 1.4-2.7): float32 ≤ 1.1e-5.
ATOL = 1e-4
PROMPT_LEN, PREFILL_CHUNK, DECODE_STEPS = 20, 12, 32  # a 12-token chunk, then an 8-token one


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 259, (length - 1,), generator=gen).tolist()]


def generate_paged(model, prompt_ids: list[int], block_size: int = 4):
    """Chunked prefill then greedy decode; returns (prefill logits, decode logits, all tokens)."""
    kv = HybridKV(model, num_blocks=64, block_size=block_size)
    chunks = [
        kv.step([("s", prompt_ids[a : a + PREFILL_CHUNK])])[0]
        for a in range(0, len(prompt_ids), PREFILL_CHUNK)
    ]
    prefill = torch.cat(chunks)  # [PROMPT_LEN, vocab]
    tokens, decode, last = list(prompt_ids), [], prefill[-1]
    for _ in range(DECODE_STEPS):
        tokens.append(int(last.argmax()))
        last = kv.step([("s", [tokens[-1]])])[0][0]
        decode.append(last)
    for g in kv.state_groups:  # one live state block, at the last token's position
        assert sum(b != 0 for b in kv.tables["s"][g]) == 1
    return prefill, torch.stack(decode), tokens


def assert_matches_transformers(folder, seed: int, block_size: int = 4) -> list[int]:
    prefill, decode, tokens = generate_paged(load_hybrid(folder), prompt(seed), block_size)
    expected = hf_logits(hf_model(folder, torch.float32), tokens)
    torch.testing.assert_close(prefill, expected[:PROMPT_LEN], atol=ATOL, rtol=0)
    torch.testing.assert_close(decode[:-1], expected[PROMPT_LEN:-1], atol=ATOL, rtol=0)
    hf_greedy = expected[PROMPT_LEN - 1 : -1].argmax(dim=-1).tolist()
    assert tokens[PROMPT_LEN:] == hf_greedy
    return hf_greedy


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_logits_and_greedy_tokens_match_transformers(tiny_model_dir, arch):
    greedy = assert_matches_transformers(tiny_model_dir(arch), seed=1)
    assert len(set(greedy)) >= 4  # the continuation is not a single repeated token


@pytest.mark.parametrize(
    ("arch", "config", "block_size"),
    [
        # Falcon-H1 with the mixer's grouped RMSNorm, gate after or before the norm
        ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, 4),
        ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}, 8),
        ("falcon_h1", {"mamba_n_groups": 1, "attention_bias": True, "projectors_bias": True}, 4),
        ("falcon_h1", {"mamba_chunk_size": 3, "mamba_d_conv": 2}, 4),  # odd scan chunk, kernel 2
        ("granite_hybrid", {"num_experts": 0}, 4),  # dense, like Granite-4.0-H-Micro
        ("granite_hybrid", {"position_embedding_type": "rope", "mamba_proj_bias": True}, 8),
        ("granite_hybrid", {"layer_types": ("attention", "mamba", "mamba", "attention")}, 4),
    ],
)
def test_variants_match_transformers(tiny_model_dir, arch, config, block_size):
    assert_matches_transformers(tiny_model_dir(arch, **config), seed=5, block_size=block_size)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_loads_what_transformers_saves(tiny_model_dir, tmp_path, arch):
    """HF v5 writes `rope_parameters`, new layer-type and MoE names, and a shard index."""
    folder = tiny_model_dir(arch)
    saved = tmp_path / "saved"
    hf_model(folder, torch.float32).save_pretrained(saved, max_shard_size="40KB")
    assert (saved / "model.safetensors.index.json").is_file()
    prefill, _, _ = generate_paged(load_hybrid(saved), prompt(seed=4))
    original, _, _ = generate_paged(load_hybrid(folder), prompt(seed=4))
    torch.testing.assert_close(prefill, original, atol=0, rtol=0)


def test_every_multiplier_changes_the_model(tiny_model_dir):
    """The goldens would miss a multiplier kvtier ignores only if it had no effect: each does."""
    base = hf_logits(hf_model(tiny_model_dir("falcon_h1"), torch.float32), prompt(2))
    for key in ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier"):
        changed = tiny_model_dir("falcon_h1", **{key: 1.0})
        assert (hf_logits(hf_model(changed, torch.float32), prompt(2)) - base).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("arch", "config"), [("falcon_h1", {}), ("granite_hybrid", {"num_experts": 0})]
)
def test_bfloat16_is_as_accurate_as_transformers_bfloat16(tiny_model_dir, arch, config):
    """Both against float64 truth (HF's float64 path still scans in float32, which bounds it):
    our mean error is no worse than HF's in bfloat16, and argmax mostly agrees. (HF's float64
    experts do not run: `torch._grouped_mm` has no float64 kernel, hence the dense Granite.)"""
    folder = tiny_model_dir(arch, **config)
    tokens = prompt(seed=2) + list(range(40, 72))
    truth = hf_logits(hf_model(folder, torch.float64), tokens)
    hf_err = (hf_logits(hf_model(folder, torch.bfloat16), tokens).double() - truth).abs().mean()
    kv = HybridKV(load_hybrid(folder, dtype="bfloat16"), num_blocks=64, block_size=4)
    ours = torch.cat(
        [kv.step([("s", tokens[:PROMPT_LEN])])[0]]
        + [kv.step([("s", [t])])[0] for t in tokens[PROMPT_LEN:]]
    ).double()
    assert kv.state_caches[0].ssm.dtype == torch.bfloat16
    assert (ours - truth).abs().mean() <= 1.1 * hf_err + 1e-3
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.9
