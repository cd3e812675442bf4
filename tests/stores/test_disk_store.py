"""`DiskStore` on real files: round trips, restarts, another model's or layout's blocks refused,
torn, truncated and corrupted files read as misses and deleted, the size limit held by chain-aware
LRU eviction, back-pressure drops, and a full disk (a real small tmpfs where this machine lets us
mount one in a user namespace, and a file-size limit) dropping writes without a crash."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.stores import DiskStore, StoreKey, StoreLayout, chain_keys
from kvtier.stores.frame import frame_size

LAYOUT = StoreLayout("0123456789abcdef0123456789abcdef", 1, "bfloat16", 16)
ROOT = Path(__file__).resolve().parents[2]


def chain(n: int, salt: int = 0, layout: StoreLayout = LAYOUT) -> list[StoreKey]:
    return chain_keys(layout, 0, [bytes([salt, i]) * 8 for i in range(n)])


def payload(key: StoreKey, size: int = 1000) -> bytes:
    return (key.block_hash * (size // len(key.block_hash) + 1))[:size]


def stored(store: DiskStore, keys: list[StoreKey]) -> None:
    assert store.put([(k, payload(k)) for k in keys]) == len(keys)
    assert store.flush(30)


def test_round_trip_and_misses_are_not_errors(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    keys = chain(4)
    stored(store, keys[:3])
    assert store.get(keys) == [payload(k) for k in keys[:3]] + [None]
    assert store.contains(keys) == [True, True, True, False]
    assert store.put([(keys[0], payload(keys[0]))]) == 1  # already stored: not rewritten
    s = store.stats()
    assert (s.num_queries, s.num_hits, s.num_puts, s.num_errors) == (8, 3, 3, 0)
    assert s.bytes_in == s.bytes_out == 3 * frame_size(keys[0], 1000) == store.num_bytes
    assert s.get_latency.count == 1 and s.put_latency.count >= 1
    store.close()


def test_a_restarted_store_finds_its_blocks_and_refuses_other_models_and_layouts(
    tmp_path: Path,
) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    keys = chain(3)
    stored(store, keys)
    store.close()
    again = DiskStore(tmp_path, 1 << 20)
    assert again.num_blocks == 3
    assert again.get(keys) == [payload(k) for k in keys]
    for other in (
        StoreLayout("f" * 32, 1, "bfloat16", 16),  # another model
        StoreLayout(LAYOUT.model_fingerprint, 2, "bfloat16", 16),  # another layout version
        StoreLayout(LAYOUT.model_fingerprint, 1, "float16", 16),  # another dtype
        StoreLayout(LAYOUT.model_fingerprint, 1, "bfloat16", 32),  # another block size
    ):
        assert again.get(chain(3, layout=other)) == [None] * 3
    assert again.get(chain_keys(LAYOUT, 1, [k.block_hash for k in keys])) == [None] * 3  # group
    # A file moved under another key's name (a digest collision, a botched copy) is refused too.
    foreign = chain(1, salt=9)[0]
    src = again._path(keys[0].digest().hex())
    dst = again._path(foreign.digest().hex())
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(src, dst)
    again.close()
    third = DiskStore(tmp_path, 1 << 20)
    assert third.get([foreign]) == [None] and not dst.exists()
    assert third.stats().num_corrupt == 1
    third.close()


def test_a_second_process_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(ValueError, match="in use by another kvtier process"):
        DiskStore(tmp_path, 1 << 20)
    store.close()
    DiskStore(tmp_path, 1 << 20).close()


def test_truncated_corrupted_and_torn_files_are_misses_and_deleted(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    keys = chain(4)
    stored(store, keys)
    paths = [store._path(k.digest().hex()) for k in keys]
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[: len(data) // 2])  # truncated
    raw = bytearray(paths[1].read_bytes())
    raw[-10] ^= 0xFF  # a flipped payload byte
    paths[1].write_bytes(bytes(raw))
    paths[2].write_bytes(b"")  # torn to nothing
    assert store.get(keys) == [None, None, None, payload(keys[3])]
    assert [p.exists() for p in paths] == [False, False, False, True]
    assert store.stats().num_corrupt == 3 and store.num_blocks == 1
    paths[3].unlink()  # deleted behind the store's back: a miss, forgotten
    assert store.get(keys[3:]) == [None] and store.num_blocks == 0
    store.close()


def test_temp_files_of_a_crashed_write_are_removed_at_start(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    key = chain(1)[0]
    stored(store, [key])
    final = store._path(key.digest().hex())
    store.close()
    torn = final.with_name(final.stem + ".1234.tmp")
    torn.write_bytes(final.read_bytes()[:50])
    final.unlink()
    reopened = DiskStore(tmp_path, 1 << 20)
    assert not torn.exists() and reopened.num_blocks == 0 and reopened.get([key]) == [None]
    reopened.close()


def test_a_non_empty_folder_it_did_not_make_is_refused_and_left_alone(tmp_path: Path) -> None:
    """Pointed at a folder of someone else's files (`--kv-disk-path ~/data`), the store refuses
    with the path and the fix, and deletes, moves and creates nothing there."""
    (tmp_path / "ab").mkdir()
    theirs = [tmp_path / "ab" / "draft.tmp", tmp_path / "notes.txt"]
    for f in theirs:
        f.write_text("keep me")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as err:
        DiskStore(tmp_path, 1 << 20)
    assert str(tmp_path) in str(err.value) and "empty" in str(err.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert all(f.read_text() == "keep me" for f in theirs)


def test_an_empty_folder_is_claimed_and_reopened(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    store = DiskStore(tmp_path / "kv", 1 << 20)
    keys = chain(2)
    stored(store, keys)
    store.close()
    reopened = DiskStore(tmp_path / "kv", 1 << 20)
    assert reopened.get(keys) == [payload(k) for k in keys]
    reopened.close()


def test_only_its_own_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    """Inside its own folder, a file it did not name is never touched, even a *.tmp."""
    store = DiskStore(tmp_path, 1 << 20)
    key = chain(1)[0]
    stored(store, [key])
    final = store._path(key.digest().hex())
    store.close()
    mine = final.with_name(final.stem + ".1234.tmp")
    mine.write_bytes(b"torn")
    other = [final.with_name("backup.tmp"), tmp_path / "zz" / "x.tmp", final.with_name("a.kvb")]
    other[1].parent.mkdir()
    for f in other:
        f.write_text("not the store's")
    reopened = DiskStore(tmp_path, 1 << 20)
    assert not mine.exists() and all(f.read_text() == "not the store's" for f in other)
    assert reopened.num_blocks == 1 and reopened.get([key]) == [payload(key)]
    reopened.close()


def test_the_size_limit_holds_and_evicts_a_chain_from_its_tail(tmp_path: Path) -> None:
    size = frame_size(chain(1)[0], 1000)
    store = DiskStore(tmp_path, 6 * size)
    a, b = chain(4, salt=1), chain(4, salt=2)
    stored(store, a)
    stored(store, b)  # 8 blocks into room for 6: a's tail goes first, its head is kept
    assert store.num_bytes <= 6 * size and store.num_blocks == 6
    assert store.contains(a) == [True, True, False, False]
    assert store.contains(b) == [True] * 4
    assert store.get(a[:2]) == [payload(k) for k in a[:2]]  # a's head is used again
    c = chain(2, salt=3)
    stored(store, c)  # now b is least recently used, from its tail
    assert store.contains(a[:2]) == [True, True] and store.contains(b) == [True, True, False, False]
    assert store.stats().num_evicted == 4
    store.close()
    smaller = DiskStore(tmp_path, 3 * size)  # restarted with a smaller limit: LRU order kept
    assert smaller.num_blocks == 3
    assert smaller.contains(c) == [True, True] and smaller.contains(a[:1]) == [True]
    smaller.close()


def test_writes_past_the_queue_bound_are_dropped_and_counted(tmp_path: Path) -> None:
    keys = chain(3)
    one = frame_size(keys[0], 1000)
    store = DiskStore(tmp_path, 1 << 20, max_pending_bytes=one)
    assert store.put([(k, payload(k)) for k in keys]) <= 1  # the head, if the queue is empty
    assert store.flush(30)
    s = store.stats()
    assert s.num_dropped >= 2 and s.num_puts + s.num_dropped == 3
    big = DiskStore(tmp_path / "tiny", one - 1)  # a block larger than the whole store
    assert big.put([(keys[0], payload(keys[0]))]) == 0 and big.stats().num_dropped == 1
    store.close()
    big.close()


FULL_DISK = """
import json, resource, sys
sys.path.insert(0, {src!r}); sys.path.insert(0, {root!r})
if {fsize}:
    resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))
from kvtier.stores import DiskStore
from tests.stores.test_disk_store import chain, payload
store = DiskStore({folder!r}, 1 << 30)  # the limit is far above what the disk holds
sizes = {sizes!r}
keys = chain(len(sizes))
for k, size in zip(keys, sizes):
    store.put([(k, payload(k, size))])
    store.flush(30)
got = store.get(keys)
s = store.stats()
assert all(g is None or g == payload(k, n) for g, k, n in zip(got, keys, sizes))
store.close()
print(json.dumps({{"hits": sum(g is not None for g in got), "errors": s.num_errors,
                  "dropped": s.num_dropped, "puts": s.num_puts}}))
"""


def _full_disk_run(cmd: list[str], folder: str, fsize: int, sizes: list[int]) -> dict[str, int]:
    code = FULL_DISK.format(
        src=str(ROOT / "src"), root=str(ROOT), folder=folder, fsize=fsize, sizes=sizes
    )
    out = subprocess.run([*cmd, sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "disk full" in out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_full_disk_drops_writes_counts_errors_and_never_crashes_fsize(tmp_path: Path) -> None:
    """A file-size limit (RLIMIT_FSIZE, 10 KB) makes every larger write fail with EFBIG; smaller
    blocks written afterwards land."""
    result = _full_disk_run([], str(tmp_path / "store"), 10_000, [20_000] * 20 + [5_000] * 5)
    assert result == {"hits": 5, "errors": 20, "dropped": 20, "puts": 5}


def test_a_full_disk_drops_writes_counts_errors_and_never_crashes_tmpfs(tmp_path: Path) -> None:
    """A real 256 KiB tmpfs, mounted in a private user and mount namespace (no root needed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs {mnt}"],
        capture_output=True,
        text=True,
    )
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    script = tmp_path / "run.sh"
    script.write_text(
        textwrap.dedent(f"""\
        mount -t tmpfs -o size=256k tmpfs {mnt} && exec "$@"
        """)
    )
    cmd = ["unshare", "-rm", "sh", str(script)]
    result = _full_disk_run(cmd, str(mnt / "store"), 0, [20_000] * 40)
    assert result["errors"] >= 1 and result["puts"] >= 5  # some fit in 256 KiB, then ENOSPC
    assert result["hits"] == result["puts"] == 40 - result["dropped"]


def test_close_twice_is_harmless(tmp_path: Path) -> None:
    """`EngineCore.close` is idempotent, and it closes its stores each time: a second close
    used to unlock a lock file already closed (ValueError)."""
    store = DiskStore(tmp_path, 1 << 20)
    store.close()
    store.close()
    DiskStore(tmp_path, 1 << 20).close()  # the folder is free again
