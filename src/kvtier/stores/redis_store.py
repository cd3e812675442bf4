"""`RedisStore`: KV blocks in Redis or Valkey (standalone or Cluster), shared by every replica
that points at the same server.

Values are frames (`stores/frame.py`); a missing, evicted or corrupt value is a miss. The caller's
thread never talks to Redis: gets run on reader threads and the caller waits at most
`get_timeout_s`, then reads misses; while a read that missed its deadline still hangs, later reads
answer misses at once (a hung server costs one deadline, not one per lookup). Sets run on a writer
thread behind a queue bounded in bytes and are dropped past it. A lost connection is closed and
retried after a doubling backoff (until then every operation answers at once: misses, drops). An
out-of-memory reply (`maxmemory` under `noeviction` or `volatile-*`) is a refused store: counted,
the connection kept, reads unaffected, and stores paused for `oom_pause_s`. A Cluster is detected
at connect with `CLUSTER INFO` (never `INFO`, which ACL'd users may lack); keys carry a hash tag
per chain segment (`keys.chain_keys`), so a batch within a segment is one MGET on one node.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError, OutOfMemoryError, RedisError, ResponseError
from redis.retry import Retry

from kvtier.stores.frame import CorruptFrame, decode_frame, encode_frame, frame_size
from kvtier.stores.keys import StoreKey
from kvtier.stores.metrics import StoreMetrics, StoreStats
from kvtier.stores.writer import BoundedWriter

log = logging.getLogger("kvtier.stores")

T = TypeVar("T")
Client = redis.Redis | RedisCluster
_SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "valkey": "redis"}
_SCHEMES["valkeys"] = "rediss"
_WARN_EVERY_S = 10.0


class _Unavailable(Exception):
    """Redis failed recently; no new attempt before the backoff ends."""


class _Read:
    """One read on a reader thread. Fields change under the store's `_lock`."""

    __slots__ = ("finished", "late")

    def __init__(self) -> None:
        self.finished = False  # the reader thread is done with it
        self.late = False  # its caller stopped waiting while it still ran


def redis_url(url: str) -> tuple[str, str]:
    """(the URL for the redis client, a loggable `host:port/db` without credentials); raises
    ValueError for another scheme."""
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None:
        raise ValueError(
            f"remote store URL {url!r} must start with redis://, rediss://, unix://, valkey:// "
            "or valkeys://, e.g. redis://127.0.0.1:6379/0"
        )
    where = parts.path if scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}{parts.path}"
    return urlunsplit(parts._replace(scheme=scheme)), where


class RedisStore:
    """A `BlockStore` on a Redis or Valkey server or cluster (see the module docstring).

    `ttl_s`: expiry of each stored block (None: none; an `allkeys-*` `maxmemory` policy evicts,
    a `volatile-*` one needs it). `io_timeout_s`: socket timeout of one command on the I/O
    threads. `oom_pause_s`: how long stores are refused after Redis answered out of memory.
    """

    def __init__(
        self,
        url: str,
        *,
        get_timeout_s: float = 0.1,
        ttl_s: float | None = None,
        max_pending_bytes: int = 64 << 20,
        io_timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        num_readers: int = 2,
        oom_pause_s: float = 1.0,
    ) -> None:
        self.url, self.where = redis_url(url)
        positive = ("get_timeout_s", get_timeout_s), ("io_timeout_s", io_timeout_s)
        for name, value in (*positive, ("oom_pause_s", oom_pause_s)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if not 0 < min_backoff_s <= max_backoff_s:
            raise ValueError("backoffs must satisfy 0 < min_backoff_s <= max_backoff_s")
        self.get_timeout_s = get_timeout_s
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.metrics = StoreMetrics()
        self._io_timeout_s = io_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._oom_pause_s = oom_pause_s
        self._refuse_until = 0.0  # stores are refused before this (after an out-of-memory reply)
        self._last_warning = -_WARN_EVERY_S
        self._lock = threading.Lock()  # the read counts; never held across I/O
        self._conn_lock = threading.Lock()  # the connection state; held by I/O threads only
        # INVARIANT: `_client` is None while `_down_until` lies ahead (after a failure).
        self._client: Client | None = None
        self._down_until = 0.0
        self._backoff_s = min_backoff_s
        self._down = False
        self._max_pending_reads = 4 * num_readers
        self._pending_reads = 0
        self._num_late = 0  # reads whose caller stopped waiting, still running
        self._readers = ThreadPoolExecutor(num_readers, thread_name_prefix="kvtier-redis-get")
        self._on_removed: Callable[[list[StoreKey]], None] | None = None
        self._writer: BoundedWriter[Callable[[], None]] = BoundedWriter(
            "kvtier-redis-set", lambda job: job(), 1, max_pending_bytes
        )

    @property
    def is_cluster(self) -> bool:
        """True once connected to a Redis Cluster."""
        with self._conn_lock:
            return isinstance(self._client, RedisCluster)

    # -- the connection ------------------------------------------------------------------------

    def _connect(self) -> Client:
        kwargs: dict[str, Any] = {
            "socket_timeout": self._io_timeout_s,
            "socket_connect_timeout": self._connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),  # we retry, with our backoff, never in a call
        }
        plain = redis.Redis.from_url(self.url, **kwargs)
        try:
            plain.cluster("INFO")
        except (NoPermissionError, ResponseError) as exc:
            # "cluster support disabled", or a user without CLUSTER: standalone either way
            log.debug("redis %s: standalone (CLUSTER INFO: %s)", self.where, exc)
            return plain
        except BaseException:
            plain.close()
            raise
        plain.close()
        return RedisCluster.from_url(self.url, **kwargs)

    def _call(self, fn: Callable[[Client], T]) -> T:
        """Run `fn` on the client (connecting first if needed) on an I/O thread; a failure
        closes the connection and starts the backoff."""
        with self._conn_lock:
            if self._client is None and time.monotonic() < self._down_until:
                raise _Unavailable
            try:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
            except (RedisError, OSError) as exc:
                self._failed(exc)
                raise
        try:
            result = fn(client)
        except ResponseError:
            raise  # Redis answered (an error reply): the connection is sound
        except (RedisError, OSError) as exc:
            with self._conn_lock:
                if self._client is client:
                    self._failed(exc)
            raise
        if self._down:
            with self._conn_lock:
                if self._down:
                    self._down = False
                    self._backoff_s = self._min_backoff_s
                    log.warning("redis %s: reachable again", self.where)
        return result

    def _failed(self, exc: BaseException) -> None:
        """Drop the connection and back off. Caller holds `_conn_lock`."""
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError):
                self._client.close()
        self._client = None
        self._down_until = time.monotonic() + self._backoff_s
        log.warning(
            "redis %s: %s: %s; retrying in %.2f s",
            self.where,
            type(exc).__name__,
            exc,
            self._backoff_s,
        )
        self._backoff_s = min(2 * self._backoff_s, self._max_backoff_s)
        self._down = True
        self.metrics.count(num_errors=1)

    def _warn(self, message: str) -> None:
        """Log `message`, at most once per `_WARN_EVERY_S` (a refusal repeats on every call)."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(message)

    def _read(self, fn: Callable[[Client], T]) -> T | None:
        """`fn` run on a reader thread; None if it failed or missed the get deadline."""
        with self._lock:
            # A read past its deadline still hangs: Redis is stuck, so answer at once.
            if self._num_late or self._pending_reads >= self._max_pending_reads:
                self.metrics.count(num_timeouts=1)
                return None
            self._pending_reads += 1
        read = _Read()
        fut: Future[T] = self._readers.submit(self._run_read, fn, read)
        try:
            return fut.result(timeout=self.get_timeout_s)
        except FutureTimeout:
            cancelled = fut.cancel()  # never started: _run_read will not count it down
            with self._lock:
                if cancelled:
                    self._pending_reads -= 1
                elif not read.finished:
                    read.late = True
                    self._num_late += 1
            self.metrics.count(num_timeouts=1)
        except ResponseError as exc:
            self.metrics.count(num_errors=1)
            self._warn(f"redis {self.where}: read refused: {exc}")
        except (_Unavailable, RedisError, OSError):
            pass  # counted by _failed
        return None

    def _run_read(self, fn: Callable[[Client], T], read: _Read) -> T:
        try:
            return self._call(fn)
        finally:
            with self._lock:
                self._pending_reads -= 1
                read.finished = True
                self._num_late -= read.late

    # -- the store -----------------------------------------------------------------------------

    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        """Payloads of `keys` (one MGET per node), None per miss; all misses past the deadline
        or while Redis is unreachable. A corrupt value is deleted in the background."""
        start = time.perf_counter()
        names = [k.name for k in keys]

        def mget(client: Client) -> list[Any]:
            if isinstance(client, RedisCluster):
                return client.mget_nonatomic(names)
            return client.mget(names)

        values = self._read(mget) if keys else []
        out: list[bytes | None] = []
        bad: list[str] = []
        num_bytes = 0
        for key, value in zip(keys, values or [None] * len(keys)):
            payload = None
            if value is not None:
                try:
                    payload = decode_frame(key, value)
                    num_bytes += len(value)
                except CorruptFrame as exc:
                    log.warning(
                        "redis %s: deleting corrupt block %s: %s", self.where, key.name, exc
                    )
                    bad.append(key.name)
            out.append(payload)
        if bad:
            self.metrics.count(num_corrupt=len(bad))
            self._writer.submit(lambda: self._delete(bad), 1)
        hits = sum(p is not None for p in out)
        self.metrics.count(num_queries=len(keys), num_hits=hits, bytes_out=num_bytes)
        self.metrics.observe("get", time.perf_counter() - start)
        return out

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key exists (one pipeline of EXISTS); all False past the deadline."""
        names = [k.name for k in keys]

        def exists(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        found = self._read(exists) if keys else []
        self.metrics.count(num_queries=len(keys))
        return [bool(f) for f in found] if found else [False] * len(keys)

    def put(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        """Queue `items` (chain order) for the writer thread; see `BlockStore.put`. What does not
        fit the queue is dropped from the tail."""
        room, size, n = self._writer.room(), 0, 0
        for key, payload in items:
            size += frame_size(key, len(payload))
            if size > room:
                break
            n += 1
        todo = list(items[:n])
        nbytes = sum(frame_size(k, len(p)) for k, p in todo)
        if n and not self._writer.submit(lambda: self._write(todo), nbytes):
            n = 0
        self.metrics.count(num_dropped=len(items) - n)
        self._report([k for k, _ in items[n:]])
        return n

    def watch_removals(self, fn: Callable[[list[StoreKey]], None]) -> None:
        """See `BlockStore.watch_removals`. Reported: sets dropped, refused or failed; a key the
        server expires (`ttl_s`) or evicts under its own `maxmemory` policy goes unseen."""
        self._on_removed = fn

    def _report(self, keys: list[StoreKey]) -> None:
        fn = self._on_removed
        if keys and fn is not None:
            fn(keys)

    def _write(self, items: list[tuple[StoreKey, bytes]]) -> None:
        start = time.perf_counter()
        frames = [(k.name, encode_frame(k, p)) for k, p in items]

        def pipeline(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, frame in frames:
                pipe.set(name, frame, px=self.ttl_ms)
            return pipe.execute(raise_on_error=False)

        if time.monotonic() < self._refuse_until:  # Redis is full: let reads have it
            self.metrics.count(num_refused=len(frames))
            self._report([k for k, _ in items])
            return
        try:
            replies = self._call(pipeline)
        except (_Unavailable, RedisError, OSError):
            self.metrics.count(num_dropped=len(frames))
            self._report([k for k, _ in items])
            return
        self._report([k for (k, _), r in zip(items, replies) if isinstance(r, Exception)])
        written = [f for (_, f), r in zip(frames, replies) if not isinstance(r, Exception)]
        full = sum(isinstance(r, OutOfMemoryError) for r in replies)
        failed = len(frames) - len(written) - full
        if full:
            self._refuse_until = time.monotonic() + self._oom_pause_s
            self._warn(
                f"redis {self.where}: out of memory (maxmemory under noeviction, or volatile-* "
                "without --kv-remote-ttl-s); stores are refused and paused while it lasts"
            )
        if failed:
            first = next(
                r
                for r in replies
                if isinstance(r, Exception) and not isinstance(r, OutOfMemoryError)
            )
            self._warn(f"redis {self.where}: {failed} sets refused: {first}")
        self.metrics.count(
            num_puts=len(written),
            num_refused=full,
            num_dropped=failed,
            num_errors=int(failed > 0),
            bytes_in=sum(len(f) for f in written),
        )
        self.metrics.observe("put", time.perf_counter() - start)

    def _delete(self, names: list[str]) -> None:
        def delete(client: Client) -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

        # On failure the value is left to Redis's eviction; a later get deletes it again.
        with contextlib.suppress(_Unavailable, RedisError, OSError):
            self._call(delete)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued sets and deletes; False if `timeout` seconds passed first."""
        return self._writer.flush(timeout)

    def stats(self) -> StoreStats:
        """The counters now."""
        return self.metrics.snapshot()

    def close(self) -> None:
        """Finish queued writes, stop the threads and close the connection."""
        self._writer.close()
        self._readers.shutdown(wait=False, cancel_futures=True)
        with self._conn_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
