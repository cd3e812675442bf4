"""Store keys, the stored frame and the model fingerprint: identity covers every layout field, any
damage to a frame is detected, and fingerprints are stable but change with the model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.stores import (
    CorruptFrame,
    StoreLayout,
    chain_keys,
    decode_frame,
    encode_frame,
    model_fingerprint,
)
from kvtier.stores.frame import HEADER_BYTES
from tests.torch_blocked import run_without_torch

FP = "0123456789abcdef0123456789abcdef"
LAYOUT = StoreLayout(FP, 1, "bfloat16", 16)
HASHES = [bytes([i]) * 16 for i in range(1, 6)]


def test_every_layout_field_and_the_group_change_the_key() -> None:
    base = LAYOUT.key(0, HASHES[0], HASHES[0])
    others = [
        StoreLayout("f" * 32, 1, "bfloat16", 16).key(0, HASHES[0], HASHES[0]),
        StoreLayout(FP, 2, "bfloat16", 16).key(0, HASHES[0], HASHES[0]),
        StoreLayout(FP, 1, "float32", 16).key(0, HASHES[0], HASHES[0]),
        StoreLayout(FP, 1, "bfloat16", 32).key(0, HASHES[0], HASHES[0]),
        LAYOUT.key(1, HASHES[0], HASHES[0]),
        LAYOUT.key(0, HASHES[1], HASHES[0]),
    ]
    names = {base.name, *(k.name for k in others)}
    digests = {base.digest(), *(k.digest() for k in others)}
    assert len(names) == len(digests) == 1 + len(others)


def test_the_hash_tag_holds_only_fingerprint_and_segment_tag() -> None:
    keys = chain_keys(LAYOUT, 0, HASHES, start=1, segment_blocks=2)
    assert [k.block_hash for k in keys] == HASHES[1:]
    assert [k.chain_tag for k in keys] == [HASHES[0], HASHES[2], HASHES[2], HASHES[4]]
    name = keys[0].name
    tag = name[name.index("{") + 1 : name.index("}")]
    assert tag == f"{FP[:16]}:{HASHES[0].hex()}"
    assert name.count("{") == name.count("}") == 1
    assert keys[0].chain_tag == chain_keys(LAYOUT, 0, HASHES)[1].chain_tag  # default: one segment


@pytest.mark.parametrize(
    "make",
    [
        lambda: StoreLayout("xyz", 1, "bfloat16", 16),
        lambda: StoreLayout(FP, -1, "bfloat16", 16),
        lambda: StoreLayout(FP, 1, "bf 16", 16),
        lambda: StoreLayout(FP, 1, "bfloat16", 0),
        lambda: LAYOUT.key(-1, b"h", b"h"),
        lambda: LAYOUT.key(0, b"", b"h"),
        lambda: chain_keys(LAYOUT, 0, HASHES, segment_blocks=0),
        lambda: chain_keys(LAYOUT, 0, HASHES, start=9),
    ],
)
def test_bad_layouts_and_keys_are_value_errors(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        make()


def test_a_frame_round_trips_and_every_damage_is_detected() -> None:
    key, other = chain_keys(LAYOUT, 0, HASHES[:2])
    payload = bytes(range(256)) * 4
    frame = encode_frame(key, payload)
    assert decode_frame(key, frame) == payload
    damaged = {
        "empty": b"",
        "header only": frame[:HEADER_BYTES],
        "truncated": frame[:-1],
        "extended": frame + b"\0",
        "other key": encode_frame(other, payload),
        "other dtype": encode_frame(
            StoreLayout(FP, 1, "float16", 16).key(0, *HASHES[:1] * 2), payload
        ),
    }
    for i in range(0, len(frame), 7):  # a flipped bit anywhere: magic, header, dtype, payload
        damaged[f"bit at {i}"] = frame[:i] + bytes([frame[i] ^ 1]) + frame[i + 1 :]
    for what, data in damaged.items():
        with pytest.raises(CorruptFrame):
            decode_frame(key, data)
            pytest.fail(what)


def _model(folder: Path, weight: bytes = b"w" * 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(weight)
    return folder


def test_fingerprint_is_stable_and_changes_with_config_or_weights(tmp_path: Path) -> None:
    m = _model(tmp_path / "m")
    first = model_fingerprint(m)
    assert first == model_fingerprint(m) and len(first) == 32
    StoreLayout(first, 1, "float32", 16)  # a valid key fingerprint
    (m / "tokenizer.json").write_text("{}")  # tokenizers do not change KV (ids are hashed)
    assert model_fingerprint(m) == first
    (m / "config.json").write_text('{"model_type": "llama", "hidden_size": 16}')
    assert model_fingerprint(m) != first
    other = _model(tmp_path / "o")
    st = os.stat(other / "model.safetensors")
    os.utime(other / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_fingerprint(other) != model_fingerprint(_model(tmp_path / "p"))


def test_content_fingerprint_ignores_mtime_and_sees_bytes(tmp_path: Path) -> None:
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    os.utime(b / "model.safetensors", ns=(1, 1))
    assert model_fingerprint(a, content=True) == model_fingerprint(b, content=True)
    assert model_fingerprint(a) != model_fingerprint(b)
    c = _model(tmp_path / "c", b"x" * 64)  # same size, other bytes
    assert model_fingerprint(c, content=True) != model_fingerprint(a, content=True)


def test_a_hub_cache_symlink_is_named_by_its_blob_hash(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / ("ab" * 32)
    blob.write_bytes(b"w" * 64)
    prints = []
    for name in ("snap1", "snap2"):
        snap = tmp_path / name
        snap.mkdir()
        (snap / "config.json").write_text("{}")
        (snap / "model.safetensors").symlink_to(blob)
        prints.append(model_fingerprint(snap))
        os.utime(blob, ns=(5, 5 + len(prints)))  # a touched blob keeps its hash name
    assert prints[0] == prints[1]


def test_fingerprint_needs_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="weight"):
        model_fingerprint(tmp_path)


def test_the_embedded_model_has_a_fingerprint() -> None:
    folder = Path(__file__).resolve().parents[2] / "src" / "kvtier" / "model" / "default"
    assert model_fingerprint(folder) == model_fingerprint(folder)


def test_stores_import_without_torch() -> None:
    out = run_without_torch(
        """
import importlib, pkgutil
import kvtier.stores
for mod in pkgutil.iter_modules(kvtier.stores.__path__):
    importlib.import_module(f"kvtier.stores.{mod.name}")
print("ok", len(list(pkgutil.iter_modules(kvtier.stores.__path__))))
"""
    )
    assert out.startswith("ok ") and int(out.split()[1]) >= 8
