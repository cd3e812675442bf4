"""The runner-facing flow in one place: load a folder, allocate KV, build metadata for a batch,
forward, select logits, sample with per-request params, detokenize with stop strings; greedy
continuations equal `transformers` `generate`."""

from __future__ import annotations

import torch

from kvtier.model import (
    AttentionMetadata,
    IncrementalDetokenizer,
    SamplingBatch,
    load_pretrained,
    sample,
)
from kvtier.sampling import DrawParams
from tests.model.reference import hf_model

BLOCK_SIZE = 4


def generate(folder, prompts: list[str], params: list[DrawParams], max_tokens: int):
    bundle = load_pretrained(folder)
    model, tok = bundle.model, bundle.tokenizer
    assert tok is not None
    groups = len(model.kv_groups)
    kv_caches = model.allocate_kv_caches(
        num_blocks=1 + 20 * groups * len(prompts), block_size=BLOCK_SIZE
    )
    prompt_ids = [tok.encode(p) for p in prompts]
    # A block id names the same block in every layer slot, so each (group, sequence) owns its own
    # ids: block_ids[group][seq] = 20 ids (enough for 80 tokens).
    block_ids = [
        [
            list(range(1 + 20 * (g * len(prompts) + i), 21 + 20 * (g * len(prompts) + i)))
            for i in range(len(prompts))
        ]
        for g in range(groups)
    ]
    tokens = [list(ids) for ids in prompt_ids]
    computed = [0] * len(prompts)
    detoks = [IncrementalDetokenizer(tok, stop=["\n"]) for _ in prompts]
    for _ in range(max_tokens):
        new = [t[c:] for t, c in zip(tokens, computed, strict=True)]
        meta = AttentionMetadata.build(computed, [len(n) for n in new], block_ids, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = model(
                torch.tensor([t for n in new for t in n]), meta.query_positions(), kv_caches, meta
            )
            last = torch.tensor(meta.query_start_loc[1:]) - 1
            logits = model.compute_logits(hidden, last)  # [num_seqs, vocab]
        batch = SamplingBatch.from_params(params, meta.seq_lens, model.config.vocab_size)
        out = sample(logits, batch, torch.Generator().manual_seed(0))
        for i, t in enumerate(out.token_ids.tolist()):
            computed[i] = len(tokens[i])
            tokens[i].append(t)
            detoks[i].push(t)
    return [t[len(p) :] for t, p in zip(tokens, prompt_ids, strict=True)], detoks


def test_greedy_generation_equals_transformers_generate(tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    prompts = ["The quick brown fox", "Paged attention is"]
    ours, _ = generate(folder, prompts, [DrawParams(temperature=0.0)] * 2, max_tokens=16)
    tok = load_pretrained(folder).tokenizer
    ref = hf_model(folder, torch.float32)
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        expected = ref.generate(
            ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, ids.shape[1] :].tolist()
        assert got == expected
    assert ours[0] != ours[1]


def test_seeded_requests_reproduce_and_stop_strings_cut(tiny_model_dir):
    folder = tiny_model_dir("llama")
    params = [
        DrawParams(temperature=1.0, top_p=0.9, seed=11),
        DrawParams(temperature=0.8, top_k=20, min_p=0.05, seed=12),
    ]
    a, detoks = generate(folder, ["one", "two two"], params, max_tokens=24)
    b, _ = generate(folder, ["one", "two two"], params, max_tokens=24)
    assert a == b
    for detok in detoks:
        assert "\n" not in detok.text
        assert detok.stop_reason in (None, "\n")
