"""Store keys, the stored frame and the model fingerprint: identity covers every layout field, any
damage to a frame is detected, and fingerprints are stable but change with the model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

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


def _model(folder: Path, seed: int = 0) -> Path:
    """A model folder with a real safetensors file (header + two tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    rng = np.random.default_rng(seed)
    tensors = {"a.weight": rng.standard_normal((8, 8), dtype=np.float32), "b": np.arange(16.0)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(autouse=True)
def _cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fingerprint cache goes under this test's own $XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _touch_all(folder: Path, ns: int) -> None:
    for f in folder.iterdir():
        os.utime(f, ns=(ns, ns))


def test_fingerprint_is_stable_and_changes_with_config_or_weights(tmp_path: Path) -> None:
    m = _model(tmp_path / "m")
    first = model_fingerprint(m)
    assert first == model_fingerprint(m) and len(first) == 32
    StoreLayout(first, 1, "float32", 16)  # a valid key fingerprint
    (m / "tokenizer.json").write_text("{}")  # tokenizers do not change KV (ids are hashed)
    assert model_fingerprint(m) == first
    (m / "config.json").write_text('{"model_type": "llama", "hidden_size": 16}')
    assert model_fingerprint(m) != first
    assert model_fingerprint(_model(tmp_path / "o", seed=1)) != model_fingerprint(
        _model(tmp_path / "p", seed=2)
    )


def test_a_copied_folder_with_new_mtimes_shares_and_one_weight_byte_does_not(
    tmp_path: Path,
) -> None:
    """Replicas deploy copies (`cp -r`, images, rsync without -t): the fingerprint is the
    weights' content, so a copy with other mtimes keys the same blocks."""
    a = _model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    _touch_all(b, 10**18)
    assert model_fingerprint(b) == model_fingerprint(a)
    weights = b / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(2 * 10**18, 2 * 10**18))
    assert model_fingerprint(b) != model_fingerprint(a)


def test_weights_are_read_once_then_cached_by_path_size_and_mtime(
    tmp_path: Path, _cache_home: Path
) -> None:
    """A restart reads no weight again: an in-place edit that keeps size and mtime goes unseen
    (the cache's one-sided failure), and dropping the cache file reads the bytes anew."""
    m = _model(tmp_path / "m")
    first = model_fingerprint(m)
    caches = list(_cache_home.glob("kvtier/**/*"))
    assert [c.name for c in caches if c.is_file()] == ["fingerprints.json"]
    weights = m / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(m) == first
    for c in caches:
        c.unlink()
    assert model_fingerprint(m) != first


def test_an_unwritable_cache_still_fingerprints(tmp_path: Path, _cache_home: Path) -> None:
    _cache_home.write_text("a file where the cache folder should be")
    m = _model(tmp_path / "m")
    assert model_fingerprint(m) == model_fingerprint(m)


def test_a_hub_cache_symlink_and_a_dereferenced_copy_share(tmp_path: Path) -> None:
    blob_dir = _model(tmp_path / "blobs")
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text((blob_dir / "config.json").read_text())
    (snap / "model.safetensors").symlink_to(blob_dir / "model.safetensors")
    copy = tmp_path / "copy"
    shutil.copytree(snap, copy, symlinks=False)
    assert model_fingerprint(snap) == model_fingerprint(copy) == model_fingerprint(blob_dir)


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
