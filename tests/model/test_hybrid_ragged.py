"""Hybrids on ragged batches and split prompts: several sequences' prefill chunks, decodes and short
multi-token queries in one forward give each sequence's logits alone; a prompt split into prefill
chunks at any points gives the logits and the Mamba states of one whole prefill (the state is
carried exactly across chunks and across state blocks); state addressing by block table."""

from __future__ import annotations

import functools
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model.hybrid import HybridLM
from kvtier.model.hybrid_loader import load_hybrid
from kvtier.model.mamba2 import StateMetadata
from kvtier.model.testing import HYBRID_ARCHITECTURES
from tests.model.hybrid_paged import HybridKV
from tests.model.test_ragged import SCHEDULE, sequences

FEW = settings(max_examples=max(10, settings.default.max_examples // 5))  # ci: 40


@functools.cache
def model64(folder: Path) -> HybridLM:
    return load_hybrid(folder, dtype="float64")


def run_schedule(model, seqs: dict[str, list[int]], block_size: int) -> dict[str, torch.Tensor]:
    kv = HybridKV(model, num_blocks=128, block_size=block_size)
    done = dict.fromkeys(seqs, 0)
    out: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in SCHEDULE:
        batch = [(s, seqs[s][done[s] : done[s] + n]) for s, n in step]
        for (s, ids), logits in zip(batch, kv.step(batch), strict=True):
            out[s].append(logits)
            done[s] += len(ids)
    return {s: torch.cat(parts) for s, parts in out.items()}


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_ragged_batch_matches_each_sequence_alone(tiny_model_dir, arch, block_size):
    model = model64(tiny_model_dir(arch))
    seqs = sequences(model.config.vocab_size)
    together = run_schedule(model, seqs, block_size)
    for s, logits in together.items():
        alone = HybridKV(model, num_blocks=128, block_size=block_size).step(
            [(s, seqs[s][: len(logits)])]
        )
        torch.testing.assert_close(logits, alone[0], atol=1e-10, rtol=0)


def test_sequence_without_tokens_this_step_changes_nothing(tiny_model_dir):
    model = model64(tiny_model_dir("granite_hybrid"))
    seqs = sequences(model.config.vocab_size)
    kv = HybridKV(model, num_blocks=64, block_size=4)
    kv.step([("b", seqs["b"][:10])])
    before = {i: (c.conv.clone(), c.ssm.clone()) for i, c in kv.state_caches.items()}
    with_idle = kv.step([("b", []), ("a", seqs["a"][:12])])
    assert with_idle[0].shape == (0, model.config.vocab_size)
    live = kv.tables["b"][1][-1]  # b's state block in Mamba group 1 (layer 0)
    torch.testing.assert_close(kv.state_caches[0].ssm[live], before[0][1][live], atol=0, rtol=0)
    alone = HybridKV(model, num_blocks=64, block_size=4).step([("a", seqs["a"][:12])])
    torch.testing.assert_close(with_idle[1], alone[0], atol=1e-10, rtol=0)


def live_states(kv: HybridKV, seq: str) -> list[torch.Tensor]:
    """Every Mamba layer's conv and SSM state of `seq` (at its live block), flattened."""
    out = []
    for layer, g in sorted(kv.model.state_group.items()):
        block = kv.tables[seq][g][-1]
        cache = kv.state_caches[layer]
        out += [cache.conv[block].flatten(), cache.ssm[block].flatten()]
    return out


@FEW
@given(
    arch=st.sampled_from(HYBRID_ARCHITECTURES),
    cuts=st.sets(st.integers(1, 28), max_size=6),
    block_size=st.sampled_from([1, 3, 4, 8]),
)
def test_prefill_split_anywhere_carries_the_state_exactly(tiny_model_dir, arch, cuts, block_size):
    model = model64(tiny_model_dir(arch))
    prompt = sequences(model.config.vocab_size)["a"][:29]
    whole = HybridKV(model, num_blocks=64, block_size=block_size)
    expected = whole.step([("s", prompt)])[0]
    split = HybridKV(model, num_blocks=64, block_size=block_size)
    bounds = [0, *sorted(cuts), len(prompt)]
    got = torch.cat([split.step([("s", prompt[a:b])])[0] for a, b in pairwise(bounds)])
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    for a, b in zip(live_states(split, "s"), live_states(whole, "s"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    for token in (5, 6, 7):  # decodes continue from either state alike
        torch.testing.assert_close(
            split.step([("s", [token])])[0], whole.step([("s", [token])])[0], atol=1e-10, rtol=0
        )


def test_the_state_is_read_from_the_block_of_the_last_computed_token(tiny_model_dir):
    """Poisoning the live state block poisons the next step; the freed one is never read."""
    model = model64(tiny_model_dir("falcon_h1"))
    prompt = sequences(model.config.vocab_size)["a"][:10]
    kv = HybridKV(model, num_blocks=64, block_size=4)
    kv.step([("s", prompt)])
    table = kv.tables["s"][1]  # the Mamba group: positions 0, 1 null, 2 holds the state after 10
    assert table[:2] == [0, 0] and table[2] != 0
    assert torch.isfinite(kv.step([("s", [5, 6])])[0]).all()  # 12 tokens: still block 2
    kv.state_caches[0].ssm[table[2]] = float("nan")
    assert torch.isnan(kv.step([("s", [7])])[0]).all()


@pytest.mark.parametrize(
    ("computed", "scheduled", "src", "dst"),
    [
        ([0], [5], [8], [8]),  # fresh: starts from zeros, src is the dst (never read)
        ([5], [2], [8], [8]),  # 5 → 7 tokens: within position 1 (tokens 5-8), in place
        ([7], [1], [8], [8]),  # 7 → 8: the state after 8 tokens ends position 1 (a snapshot)
        ([8], [1], [8], [9]),  # 8 → 9: crosses into position 2
        ([3], [10], [7], [6]),  # 3 → 13: from position 0 to position 3
    ],
)
def test_state_metadata_addresses_the_last_token_position(computed, scheduled, src, dst):
    table = [7, 8, 9, 6]  # block id per table position, block size 4
    meta = StateMetadata.build(computed, scheduled, {2: [table]}, block_size=4)
    assert meta.src_slots[2] == tuple(src) and meta.dst_slots[2] == tuple(dst)


@pytest.mark.parametrize("num_accepted", [0, 1, 3])
@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_a_rejected_draft_leaves_the_state_as_if_it_never_ran(tiny_model_dir, arch, num_accepted):
    """Verify 1 + 3 tokens from 14 (crossing the block boundary at 16), keep 1 + num_accepted:
    the kept tokens' logits, the states and everything after equal a run that never saw the
    rejected ones (to float64 rounding: a 4-query step batches its matmuls differently)."""
    model = model64(tiny_model_dir(arch))
    seqs = sequences(model.config.vocab_size)
    prompt, verified, more = seqs["a"][:14], seqs["b"][:4], seqs["c"][:3]
    drafted = HybridKV(model, num_blocks=64, block_size=4)
    drafted.step([("s", prompt)])
    got = drafted.verify("s", verified, num_accepted)[: 1 + num_accepted]
    got = torch.cat([got, *(drafted.step([("s", [t])])[0] for t in more)])
    plain = HybridKV(model, num_blocks=64, block_size=4)
    plain.step([("s", prompt)])
    kept = verified[: 1 + num_accepted]
    expected = torch.cat([plain.step([("s", [t])])[0] for t in kept + more])
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    for a, b in zip(live_states(drafted, "s"), live_states(plain, "s"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_token_slots_need_one_slot_per_scheduled_token():
    with pytest.raises(ValueError, match=r"token_slots\[2\]\[0\] has 2 slots for 3 scheduled"):
        StateMetadata.build([4], [3], {2: [[7, 8]]}, block_size=4, token_slots={2: {0: [5, 6]}})
