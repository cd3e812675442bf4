"""A model's fingerprint for store keys: the bytes of `config.json` and of every weight file
(safetensors headers and tensors alike), so every copy of a model keys the same blocks, wherever
it lives and whatever its files' times, and changed weights key others.

Reading every weight at every start would be slow, so each file's digest is cached by its resolved
path, size and modification time in `$XDG_CACHE_HOME/kvtier/fingerprints.json` (`~/.cache` when
unset). The cache's failure is one-sided: only an in-place edit that keeps a file's size and mtime
could keep a stale digest, which no normal tool does. An unwritable cache only costs the reading.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import xxhash

log = logging.getLogger("kvtier.stores")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 16 << 20


def cache_file() -> Path:
    """Where weight digests are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "fingerprints.json"


def _weight_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.resolve().is_file()
    )


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _load(cache: Path) -> dict[str, dict[str, int | str]]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(cache: Path, entries: dict[str, dict[str, int | str]]) -> None:
    """Replace the cache file whole (a concurrent start sees the old one or the new one),
    without the entries of files that are gone."""
    kept = {path: e for path, e in entries.items() if os.path.isfile(path)}
    tmp: str | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".fingerprints.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, cache)
    except OSError as exc:
        log.info(
            "fingerprint cache %s not written (%s): weights are read at each start", cache, exc
        )
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def model_fingerprint(folder: str | Path) -> str:
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
    cache = cache_file()
    entries = _load(cache)
    changed = False
    h = xxhash.xxh3_128()
    h.update(b"kvtier-model-fingerprint:v2\0")
    h.update(config.read_bytes() + b"\0")
    for path in weights:
        target = path.resolve()
        st = target.stat()
        stamp: dict[str, int | str] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        entry = entries.get(str(target))
        if entry is None or {k: entry.get(k) for k in stamp} != stamp:
            log.info("model fingerprint: hashing %s (%d bytes), once per file", target, st.st_size)
            entry = stamp | {"digest": _file_digest(target)}
            entries[str(target)] = entry
            changed = True
        h.update(f"{path.name}\0{entry['digest']}\0".encode())
    if changed:
        _save(cache, entries)
    return h.hexdigest()
