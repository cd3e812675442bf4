"""`DiskStore`: KV blocks as files under one folder, within a byte limit, surviving restarts.

Each block is one file `<root>/<d[:2]>/<d>.kvb`, `d` the hex digest of its `StoreKey` (which names
model, layout, dtype, block size and group), holding one frame (`stores/frame.py`). Writes run on a
small thread pool (temp file + rename, so a reader sees a whole file or none); a file that fails its
frame checks is deleted and read as a miss. An in-memory LRU index, rebuilt at start from the
files' modification times, keeps the total within `size_bytes`; hits and writes stamp the files
so that a chain's head is newer than its tail (evicted last, as in the host tier). One process
per folder: a second one is refused. The store claims only an empty folder (writing its marker
file, `MARKER`) or one that bears its marker, and touches only files named as it names them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.stores.frame import CorruptFrame, decode_frame, encode_frame, frame_size
from kvtier.stores.keys import StoreKey
from kvtier.stores.metrics import StoreMetrics, StoreStats
from kvtier.stores.writer import BoundedWriter

log = logging.getLogger("kvtier.stores")

SUFFIX = ".kvb"
MARKER = ".kvtier-disk-tier"  # written into a folder the store claims; its content: _MARKER_TEXT
_MARKER_TEXT = "kvtier disk KV tier: block files under two-hex-digit folders; safe to delete\n"
_SUB = re.compile(r"^[0-9a-f]{2}$")
_BLOCK = re.compile(r"^([0-9a-f]{32})\.kvb$")
_TMP = re.compile(r"^[0-9a-f]{32}\.[0-9]+\.tmp$")  # `_write_file`'s temp names
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file size limit
_WARN_EVERY_S = 10.0

_Item = tuple[StoreKey, str, bytes]  # key, hex digest, payload


class DiskStore:
    """A `BlockStore` on a local folder (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        size_bytes: int,
        *,
        num_threads: int = 2,
        max_pending_bytes: int = 64 << 20,
    ) -> None:
        if size_bytes < 1:
            raise ValueError(f"size_bytes must be positive, got {size_bytes}")
        self.root = Path(path)
        self.size_bytes = size_bytes
        self.metrics = StoreMetrics()
        _claim(self.root)
        self._lock_file = (self.root / ".lock").open("a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(
                f"{self.root} is in use by another kvtier process; give each its own disk path"
            ) from None
        self._lock = threading.Lock()
        # INVARIANT: `_index` holds digest → file size for exactly the intact-looking files
        # present, least recently used first; `_total` is the sum of its sizes; `_reserved`
        # counts the bytes of writes in progress; `_total + _reserved <= size_bytes`.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        self._reserved = 0
        self._writing: set[str] = set()
        # With a removal watcher: the key of each digest put by this process (a file found at
        # start was never announced), and the keys gone since the last report.
        self._on_removed: Callable[[list[StoreKey]], None] | None = None
        self._keys: dict[str, StoreKey] = {}
        self._gone: list[StoreKey] = []
        self._last_warning = -_WARN_EVERY_S
        self._scan()
        self._writer: BoundedWriter[list[_Item]] = BoundedWriter(
            "kvtier-disk", self._write_batch, num_threads, max_pending_bytes
        )

    # -- reads ---------------------------------------------------------------------------------

    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        """Payloads of `keys`, None per miss (absent, evicted, torn or corrupt: then deleted)."""
        start = time.perf_counter()
        out: list[bytes | None] = []
        hits: list[str] = []
        num_bytes = 0
        for key in keys:
            hx = key.digest().hex()
            with self._lock:
                present = hx in self._index
            data = self._read(hx) if present else None
            payload = None if data is None else self._decode(key, hx, data)
            if payload is not None:
                hits.append(hx)
                num_bytes += len(data or b"")
            out.append(payload)
        self._touch(hits)
        self.metrics.count(num_queries=len(keys), num_hits=len(hits), bytes_out=num_bytes)
        self.metrics.observe("get", time.perf_counter() - start)
        self._report()
        return out

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key's file is in the index (no file is read)."""
        digests = [k.digest().hex() for k in keys]
        with self._lock:
            found = [hx in self._index for hx in digests]
        self.metrics.count(num_queries=len(keys))
        return found

    def _read(self, hx: str) -> bytes | None:
        try:
            return self._path(hx).read_bytes()
        except FileNotFoundError:
            self._forget(hx)
        except OSError as exc:
            self.metrics.count(num_errors=1)
            self._warn(f"disk store {self.root}: reading a block failed: {exc}")
        return None

    def _decode(self, key: StoreKey, hx: str, data: bytes) -> bytes | None:
        try:
            return decode_frame(key, data)
        except CorruptFrame as exc:
            log.warning("disk store %s: deleting corrupt block %s: %s", self.root, hx, exc)
            self.metrics.count(num_corrupt=1)
            self._forget(hx)
            self._path(hx).unlink(missing_ok=True)
            return None

    # -- writes --------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        """Queue `items` (chain order) for the writer threads; see `BlockStore.put`. A batch that
        does not fit the queue keeps its head and drops its tail."""
        todo: list[_Item] = []
        sizes: list[int] = []
        num_queued = 0
        too_big: list[StoreKey] = []
        with self._lock:
            for key, payload in items:
                hx = key.digest().hex()
                size = frame_size(key, len(payload))
                if hx in self._index or hx in self._writing:
                    num_queued += 1
                elif size <= self.size_bytes:
                    todo.append((key, hx, payload))
                    sizes.append(size)
                else:
                    too_big.append(key)
        room, n = self._writer.room(), 0
        while n < len(todo) and sum(sizes[: n + 1]) <= room:
            n += 1
        if n and not self._writer.submit(todo[:n], sum(sizes[:n])):
            n = 0
        with self._lock:
            self._writing.update(hx for _, hx, _ in todo[:n])
            if self._on_removed is not None:
                self._keys.update((hx, key) for key, hx, _ in todo[:n])
                self._gone.extend(too_big + [key for key, _, _ in todo[n:]])
        self.metrics.count(num_dropped=len(items) - num_queued - n)
        self._report()
        return num_queued + n

    def watch_removals(self, fn: Callable[[list[StoreKey]], None]) -> None:
        """See `BlockStore.watch_removals`."""
        with self._lock:
            self._on_removed = fn

    def _drop_key(self, hx: str) -> None:
        """`hx` is gone: report its key (with the lock held)."""
        key = self._keys.pop(hx, None)
        if key is not None:
            self._gone.append(key)

    def _report(self) -> None:
        """Hand the keys gone to the watcher (without the lock)."""
        with self._lock:
            gone, self._gone = self._gone, []
            fn = self._on_removed
        if gone and fn is not None:
            fn(gone)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes; False if `timeout` seconds passed first."""
        return self._writer.flush(timeout)

    def _write_batch(self, batch: list[_Item]) -> None:
        start = time.perf_counter()
        written: list[tuple[str, int]] = []
        for key, hx, payload in batch:
            data = encode_frame(key, payload)
            if self._reserve(len(data)) and self._write_file(hx, data):
                written.append((hx, len(data)))
            else:
                self.metrics.count(num_dropped=1)
                with self._lock:
                    self._drop_key(hx)
        with self._lock:
            for hx, size in reversed(written):  # the chain's head ends most recent
                self._total += size - self._index.pop(hx, 0)
                self._index[hx] = size
                self._reserved -= size
            self._writing.difference_update(hx for _, hx, _ in batch)
        self._report()
        self._stamp([hx for hx, _ in written])
        self.metrics.count(num_puts=len(written), bytes_in=sum(s for _, s in written))
        self.metrics.observe("put", time.perf_counter() - start)

    def _reserve(self, size: int) -> bool:
        """Evict least recently used files until `size` more bytes fit; reserve them."""
        with self._lock:
            while self._total + self._reserved + size > self.size_bytes and self._index:
                hx, old = self._index.popitem(last=False)
                self._total -= old
                self._path(hx).unlink(missing_ok=True)
                self.metrics.count(num_evicted=1)
                self._drop_key(hx)
            if self._total + self._reserved + size > self.size_bytes:
                return False
            self._reserved += size
            return True

    def _write_file(self, hx: str, data: bytes) -> bool:
        final = self._path(hx)
        tmp = final.with_name(f"{hx}.{threading.get_ident()}.tmp")
        try:
            final.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as f:
                f.write(data)
            os.replace(tmp, final)
            return True
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._reserved -= len(data)
            self.metrics.count(num_errors=1)
            what = "disk full" if exc.errno in _FULL else "write failed"
            self._warn(f"disk store {self.root}: {what} ({exc}); dropping block writes")
            return False

    # -- the index -----------------------------------------------------------------------------

    def _path(self, hx: str) -> Path:
        return self.root / hx[:2] / f"{hx}{SUFFIX}"

    def _forget(self, hx: str) -> None:
        with self._lock:
            self._total -= self._index.pop(hx, 0)
            self._drop_key(hx)

    def _touch(self, hits: list[str]) -> None:
        """Hits become most recent, the chain's head last (so it is evicted last)."""
        with self._lock:
            for hx in reversed(hits):
                if hx in self._index:
                    self._index.move_to_end(hx)
        self._stamp(hits)

    def _stamp(self, digests: list[str]) -> None:
        """File times in the index's order, so a restart rebuilds the same LRU order: the first
        digest (a chain's head) gets the newest time."""
        now = time.time_ns()
        for i, hx in enumerate(digests):
            with contextlib.suppress(OSError):  # evicted or deleted meanwhile
                os.utime(self._path(hx), ns=(now - i, now - i))

    def _scan(self) -> None:
        """Rebuild the index from the files present (oldest first); delete torn temp files."""
        found: list[tuple[int, str, int]] = []
        for sub in self.root.iterdir():
            if not _SUB.match(sub.name) or not sub.is_dir():
                continue
            for f in sub.iterdir():
                block = _BLOCK.match(f.name)
                if _TMP.match(f.name):
                    f.unlink(missing_ok=True)  # a write of ours cut off by a crash
                elif block and block[1][:2] == sub.name and f.is_file():
                    st = f.stat()
                    found.append((st.st_mtime_ns, block[1], st.st_size))
        for _, hx, size in sorted(found):
            self._index[hx] = size
            self._total += size
        self._reserve(0)  # a smaller limit than last time: evict down to it

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(message)

    # -- lifecycle -----------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """The counters now, including blocks and bytes held (see `num_blocks`, `num_bytes`)."""
        return self.metrics.snapshot()

    @property
    def num_bytes(self) -> int:
        """Bytes of the block files in the index."""
        with self._lock:
            return self._total

    @property
    def num_blocks(self) -> int:
        """Block files in the index."""
        with self._lock:
            return len(self._index)

    def close(self) -> None:
        """Finish queued writes, stop the threads, release the folder (idempotent)."""
        self._writer.close()
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()


def _claim(root: Path) -> None:
    """Create `root` with the store's marker, or check that an existing one is the store's:
    a non-empty folder without the marker is someone else's and is refused untouched."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / MARKER
    if marker.is_file():
        return
    if any(root.iterdir()):
        raise ValueError(
            f"{root} is not empty and has no {MARKER} marker, so it is not a kvtier "
            "disk tier and its files are not kvtier's to delete: give an empty or new folder "
            f"(an older kvtier's tier folder: delete it, its blocks are only a cache)"
        )
    tmp = root / f"{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(_MARKER_TEXT)
    os.replace(tmp, marker)
