"""A model's fingerprint for store keys: the same folder gives the same hex digest across restarts,
another model (or the same one with changed weights) another one.

Default (`content=False`, cheap at every start): the bytes of `config.json`, and per weight file
its name, size and modification time, except that a weight file that is a symlink to a blob named
by its SHA-256 (the Hugging Face cache layout) is named by that hash instead. The failure modes are
one-sided: copying a folder without keeping mtimes changes the fingerprint (old blocks become misses
and are recomputed, then age out); only an in-place edit that keeps a file's size and mtime could
keep it, which no normal tool does. `content=True` hashes the weight bytes themselves, for folders
whose mtimes do not survive deployment, at the price of reading every weight at each start.
"""

from __future__ import annotations

import re
from pathlib import Path

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.resolve().is_file()
    )


def _identity(path: Path, content: bool, h: xxhash.xxh3_128) -> None:
    h.update(path.name.encode() + b"\0")
    target = path.resolve()
    if content:
        with target.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return
    st = target.stat()
    if path.is_symlink() and _SHA256.match(target.name):
        h.update(f"sha256={target.name};size={st.st_size}\0".encode())
    else:
        h.update(f"size={st.st_size};mtime_ns={st.st_mtime_ns}\0".encode())


def model_fingerprint(folder: str | Path, content: bool = False) -> str:
    """32 hex digits naming the model in `folder` (see the module docstring); raises ValueError
    when the folder has no config.json or no weight file."""
    root = Path(folder)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"{root} has no config.json; pass a Hugging Face model folder")
    weights = _weight_files(root)
    if not weights:
        raise ValueError(
            f"{root} has no weight file ({', '.join(WEIGHT_SUFFIXES)}); pass a model folder"
        )
    h = xxhash.xxh3_128()
    h.update(b"kvtier-model-fingerprint:v1\0" + (b"content\0" if content else b"meta\0"))
    h.update(config.read_bytes() + b"\0")
    for path in weights:
        _identity(path, content, h)
    return h.hexdigest()
