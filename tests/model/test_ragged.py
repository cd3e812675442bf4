"""Ragged batches: prefill chunks and decodes of several sequences in one forward give the logits
each sequence gets alone; metadata, slot mappings and the KV write path."""

from __future__ import annotations

import pytest
import torch

from kvtier.model.attention import AttentionMetadata, LayerKind
from kvtier.model.loader import load_model
from kvtier.model.paged import plan_group
from tests.model.paged import PagedKV

# Schedules: per step, (sequence, number of new tokens); a 1 after the prompt is a decode.
LENGTHS = {"a": 33, "b": 21, "c": 14, "d": 22}
SCHEDULE = [
    [("a", 7), ("b", 13)],
    [("b", 1), ("a", 7), ("c", 5)],
    [("c", 4), ("b", 1), ("a", 16), ("d", 3)],
    [("d", 1), ("c", 1), ("b", 1), ("a", 1)],
    [("a", 1), ("d", 17), ("b", 1), ("c", 1)],
    [("c", 3), ("a", 1), ("b", 4), ("d", 1)],  # short multi-token queries (draft verification)
]


def sequences(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {s: torch.randint(3, vocab, (n,), generator=gen).tolist() for s, n in LENGTHS.items()}


def run_schedule(model, seqs: dict[str, list[int]], block_size: int) -> dict[str, torch.Tensor]:
    kv = PagedKV(model, num_blocks=96, block_size=block_size)
    done = dict.fromkeys(seqs, 0)
    out: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in SCHEDULE:
        batch = [(s, seqs[s][done[s] : done[s] + n]) for s, n in step]
        assert all(len(ids) == n for (_, ids), (_, n) in zip(batch, step, strict=True))
        for (s, ids), logits in zip(batch, kv.step(batch), strict=True):
            out[s].append(logits)
            done[s] += len(ids)
    return {s: torch.cat(parts)[: done[s]] for s, parts in out.items() if parts}


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("arch", ["gemma3", "llama_chunked", "mistral", "gemma2", "qwen2"])
def test_ragged_batch_matches_each_sequence_alone(tiny_model_dir, arch, block_size):
    model = load_model(tiny_model_dir(arch), dtype="float64")
    seqs = sequences(model.config.vocab_size)
    together = run_schedule(model, seqs, block_size)
    for s, logits in together.items():
        alone = PagedKV(model, num_blocks=96, block_size=block_size).step(
            [(s, seqs[s][: len(logits)])]
        )
        torch.testing.assert_close(logits, alone[0], atol=1e-10, rtol=0)


def test_poisoned_out_of_window_blocks_are_never_read(tiny_model_dir):
    """Freed blocks are NaN-filled and handed to later sequences: any stray read shows as NaN."""
    model = load_model(tiny_model_dir("mistral"), dtype="float32")
    seqs = sequences(model.config.vocab_size)
    together = run_schedule(model, seqs, block_size=4)
    assert all(torch.isfinite(t).all() for t in together.values())
    kv = PagedKV(model, num_blocks=96, block_size=4)
    kv.step([("a", seqs["a"])])
    # The next query (position 33) reads keys 26-33: blocks 0-5 (positions 0-23) are pruned.
    assert kv.tables["a"][0][:7].count(0) == 6
    kv.kv_caches[0][kv.tables["a"][0][6]] = float("nan")  # block 6 holds position 26
    assert torch.isnan(kv.step([("a", [5])])[0]).all()


def test_metadata_build_slot_mapping_and_positions():
    meta = AttentionMetadata.build([5, 0], [1, 3], [[[7, 9], [4]]], block_size=4)
    assert meta.query_start_loc == (0, 1, 4)
    assert meta.seq_lens == (6, 3)
    assert meta.query_lens == [1, 3]
    assert meta.query_positions().tolist() == [5, 0, 1, 2]
    assert meta.slot_mappings[0].tolist() == [9 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    assert meta.block_tables[0].tolist() == [[7, 9], [4, 0]]


def test_negative_slot_is_not_written(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"))
    caches = model.allocate_kv_caches(num_blocks=8, block_size=4)
    meta = AttentionMetadata.build([0], [3], [[[2]]] * len(model.kv_groups), block_size=4)
    skip = tuple(s.clone().index_fill_(0, torch.tensor([2]), -1) for s in meta.slot_mappings)
    meta = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, skip, 4)
    with torch.no_grad():
        model(torch.tensor([5, 6, 7]), torch.arange(3), caches, meta)
    assert caches[0][2, :, :2].abs().sum() > 0
    assert caches[0][2, :, 2:].abs().sum() == 0


@pytest.mark.parametrize(
    ("kind", "query", "keys"),
    [
        (LayerKind(), 9, list(range(10))),
        (LayerKind(window=4), 9, [6, 7, 8, 9]),
        (LayerKind(chunk=4), 9, [8, 9]),
        (LayerKind(chunk=4), 7, [4, 5, 6, 7]),
    ],
)
def test_layer_kind_mask_and_kv_start(kind, query, keys):
    allowed = kind.mask(torch.tensor([query]), torch.arange(12))[0]
    assert torch.nonzero(allowed).flatten().tolist() == keys
    assert kind.kv_start(query) == keys[0]


def test_sequence_without_tokens_this_step_changes_nothing(tiny_model_dir):
    model = load_model(tiny_model_dir("gemma3"), dtype="float64")
    seqs = sequences(model.config.vocab_size)
    kv = PagedKV(model, num_blocks=96, block_size=4)
    kv.step([("b", seqs["b"][:10])])
    with_idle = kv.step([("b", []), ("a", seqs["a"][:12])])
    assert with_idle[0].shape == (0, model.config.vocab_size)
    alone = PagedKV(model, num_blocks=96, block_size=4).step([("a", seqs["a"][:12])])
    torch.testing.assert_close(with_idle[1], alone[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "llama_chunked"])
def test_equal_shape_prefills_share_one_call_and_match_alone(tiny_model_dir, arch):
    model = load_model(tiny_model_dir(arch), dtype="float64")
    seqs = sequences(model.config.vocab_size)
    kv = PagedKV(model, num_blocks=96, block_size=4)
    kv.step([("g", seqs["a"][:12])])
    batch = [("e", seqs["b"][:12]), ("g", seqs["a"][12:24]), ("f", seqs["d"][:12])]
    together = kv.step(batch)
    meta = AttentionMetadata.build([0, 12, 0], [12, 12, 12], [[[1, 2, 3], [4] * 6, [5] * 3]], 4)
    plan = plan_group(meta, 0, LayerKind(), 2, 2)
    assert [o.num_seqs for o in plan.owns] == [2]  # e and f: one call on their own keys
    assert [g.num_seqs for g in plan.gathers] == [1]  # g reads its cached prefix
    gathered = plan_group(meta, 0, LayerKind(), 2, 2, own_keys=False).gathers
    assert [g.num_seqs for g in gathered] == [3]  # without the own-keys path: one gather
    for (s, ids), logits in zip([batch[0], batch[2]], [together[0], together[2]], strict=True):
        alone = PagedKV(model, num_blocks=96, block_size=4).step([(s, ids)])[0]
        torch.testing.assert_close(logits, alone, atol=1e-10, rtol=0)
    g_alone = PagedKV(model, num_blocks=96, block_size=4).step([("g", seqs["a"][:24])])[0]
    torch.testing.assert_close(together[1], g_alone[12:], atol=1e-10, rtol=0)
