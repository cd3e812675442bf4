"""Chained block hashing: canonical bytes, cross-process stability, hash choice, extra keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvtier.kv import BlockHasher, HashExtras, KVSequence, MultiModalItem, get_hash_fn

BS = 4
TOKENS = list(range(100, 114))  # 3 full blocks of 4 + 2 tokens
EXTRAS = HashExtras("salt-é", "adapter", (MultiModalItem("img", 3, 6),))


def chain(tokens=TOKENS, extras=None, hash_fn="sha256", bs=BS):
    out: list[bytes] = []
    BlockHasher(bs, hash_fn).extend(out, tokens, extras)
    return out


def test_first_hash_matches_the_documented_canonical_encoding():
    """hash_0 = sha256(NONE ‖ u32 len ‖ tokens as LE u32); pins the encoding across releases."""
    none = hashlib.sha256(b"kvtier:none-hash:v1").digest()
    payload = struct.pack("<I", BS) + struct.pack("<4I", *TOKENS[:BS])
    assert chain()[0] == hashlib.sha256(none + payload).digest()


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    hashes = chain()
    assert len(hashes) == 3
    piecewise: list[bytes] = []
    hasher = BlockHasher(BS)
    for n in (1, 5, 9, 13, 14):
        hasher.extend(piecewise, TOKENS[:n], EXTRAS)
    assert piecewise == chain(extras=EXTRAS)


def test_chaining_makes_each_hash_fingerprint_its_whole_prefix():
    base = chain()
    early = chain([TOKENS[0] + 1, *TOKENS[1:]])
    late = chain([*TOKENS[:9], TOKENS[9] + 1, *TOKENS[10:]])
    assert all(a != b for a, b in zip(base, early))
    assert late[:2] == base[:2] and late[2] != base[2]


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
def test_hashes_are_identical_across_processes_with_different_hash_seeds(hash_fn):
    code = (
        "from kvtier.kv import BlockHasher, HashExtras, MultiModalItem\n"
        f"out = []; BlockHasher({BS}, {hash_fn!r}).extend(out, {TOKENS!r}, {EXTRAS!r})\n"
        "print(','.join(h.hex() for h in out))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here = ",".join(h.hex() for h in chain(extras=EXTRAS, hash_fn=hash_fn))
    assert res.stdout.strip() == here


def test_sha256_and_xxhash_both_work_and_differ():
    sha, xx = chain(hash_fn="sha256"), chain(hash_fn="xxhash")
    assert [len(h) for h in sha] == [32] * 3
    assert [len(h) for h in xx] == [16] * 3
    assert not set(sha) & set(xx)
    assert get_hash_fn("xxhash")(b"a") != get_hash_fn("xxhash")(b"b")


@pytest.mark.parametrize("make", [get_hash_fn, lambda name: BlockHasher(16, name)])
def test_unknown_hash_name_is_a_value_error_naming_the_choices(make):
    with pytest.raises(ValueError, match=r"'md5'.*\['sha256', 'xxhash'\]"):
        make("md5")


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


def test_cache_salt_enters_only_block_zero_but_changes_every_later_hash():
    plain, salted = chain(), chain(extras=HashExtras(cache_salt="s"))
    assert all(a != b for a, b in zip(plain, salted))
    hasher = BlockHasher(BS)
    # block 1 of the salted chain is the plain hash of its tokens under the salted parent
    assert salted[1] == hasher.hash_block(salted[0], TOKENS[BS : 2 * BS])
    assert HashExtras(cache_salt="s").encode(BS, 2 * BS) == b""


def test_adapter_name_enters_every_block():
    tagged = chain(extras=HashExtras(adapter_name="a"))
    hasher = BlockHasher(BS)
    assert tagged[1] != hasher.hash_block(tagged[0], TOKENS[BS : 2 * BS])
    assert tagged[1] == hasher.hash_block(
        tagged[0], TOKENS[BS : 2 * BS], HashExtras(adapter_name="a").encode(BS, 2 * BS)
    )
    assert chain(extras=HashExtras(adapter_name="b")) != tagged


def test_multimodal_item_enters_only_overlapping_blocks_with_its_offset():
    item = MultiModalItem("img", 6, 4)  # positions [6, 10): blocks 1 and 2 of size 4
    extras = HashExtras(mm_items=(item,))
    assert extras.encode(0, 4) == b""
    assert extras.encode(4, 8) != b"" and extras.encode(8, 12) != b""
    assert extras.encode(12, 16) == b""
    assert extras.encode(4, 8) != extras.encode(8, 12)  # offsets 2 and -2 within the block
    base = chain(extras=extras)
    assert base[0] == chain()[0]
    moved = chain(extras=HashExtras(mm_items=(MultiModalItem("img", 7, 4),)))
    assert moved[0] == base[0] and moved[1] != base[1]
    touching = HashExtras(mm_items=(MultiModalItem("img", 0, 4),))  # ends at block 1's start
    assert touching.encode(4, 8) == b""


def test_kv_sequence_hashes_blocks_as_output_tokens_complete_them():
    seq = KVSequence("r", TOKENS[:6], BlockHasher(BS))
    assert seq.block_hashes == chain()[:1] and seq.num_prompt_tokens == 6
    seq.append_output_token_ids(TOKENS[6:13])
    assert seq.block_hashes == chain() and seq.num_tokens == 13
    assert KVSequence("r", TOKENS).block_hashes == []  # no hasher: nothing hashed


def test_kv_sequence_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        KVSequence("r", [])
