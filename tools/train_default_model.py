"""Train kvtier's embedded default model: a small Gemma3-architecture LM on Python's own docs.

Reproducible (fixed seed, fixed data, fixed thread count): the corpus is `pydoc_data.topics`, the
documentation topics every CPython install ships; the tokenizer is a byte-level BPE trained with
`tokenizers`; the model is `transformers`' Gemma3ForCausalLM (sliding-window and global layers),
trained on the CPU and saved as an HF folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) under src/kvtier/model/default/.

    python tools/train_default_model.py            # ≈ 10 min on 2 idle cores
    python tools/train_default_model.py --steps 50 --out /tmp/m   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

OUT = Path(__file__).resolve().parent.parent / "src" / "kvtier" / "model" / "default"
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def corpus() -> list[str]:
    """The documentation topics, in sorted key order, as one document each."""
    topics = pydoc_data.topics.topics
    return [topics[k].strip() + "\n" for k in sorted(topics)]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return tok


def model_config(vocab_size: int, tok: Tokenizer) -> Gemma3TextConfig:
    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=len(pattern),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=64,
        layer_types=pattern,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=32,
        pad_token_id=tok.token_to_id("<pad>"),
        bos_token_id=tok.token_to_id("<bos>"),
        eos_token_id=tok.token_to_id("<eos>"),
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


def batches(ids: torch.Tensor, seq_len: int, batch: int, rng: random.Random):
    while True:
        starts = [rng.randrange(0, len(ids) - seq_len - 1) for _ in range(batch)]
        x = torch.stack([ids[s : s + seq_len] for s in starts])  # [batch, seq_len]
        yield x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    docs = corpus()
    tok = train_tokenizer(docs, args.vocab_size)
    eos = tok.token_to_id("<eos>")
    ids_list: list[int] = []
    for d in docs:
        ids_list += [*tok.encode(d).ids, eos]
    ids = torch.tensor(ids_list, dtype=torch.long)  # [num_corpus_tokens]
    print(f"corpus: {len(docs)} topics, {len(ids)} tokens, vocab {tok.get_vocab_size()}")

    cfg = model_config(tok.get_vocab_size(), tok)
    model = Gemma3ForCausalLM(cfg)
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, layers {cfg.layer_types}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    t0 = time.time()
    data = batches(ids, args.seq_len, args.batch, rng)
    for step in range(args.steps):
        x = next(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:7.1f}s", flush=True)

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "model_max_length": cfg.max_position_embeddings,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    meta = {
        "steps": args.steps,
        "seed": args.seed,
        "final_loss": loss.item(),
        "seconds": time.time() - t0,
    }
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved {args.out} ({meta})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
