"""`RedisStore` against real redis-server processes (free loopback ports, started and stopped
here): round trips with hiredis, a corrupted value, an evicted key, Redis killed, hung and
restarted mid-run (misses within the deadline, dropped sets, automatic reconnect), Redis out of
memory under `noeviction` (refused stores, reads unharmed), an ACL'd user without INFO, and a
three-master Redis Cluster where a chain segment's batch is one MGET on one node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.utils

from kvtier.stores import StoreKey, StoreLayout, chain_keys
from kvtier.stores.redis_store import RedisStore
from tests.stores.servers import RedisServer, start_cluster, wait_until

LAYOUT = StoreLayout("0123456789abcdef0123456789abcdef", 1, "bfloat16", 16)


def chain(n: int, salt: int = 0) -> list[StoreKey]:
    return chain_keys(LAYOUT, 0, [bytes([salt, i]) * 8 for i in range(n)], segment_blocks=4)


def payload(key: StoreKey, size: int = 1000) -> bytes:
    return (key.block_hash * (size // len(key.block_hash) + 1))[:size]


def stored(store: RedisStore, keys: list[StoreKey], size: int = 1000) -> None:
    assert store.put([(k, payload(k, size)) for k in keys]) == len(keys)
    assert store.flush(30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def fast_store(url: str, **kwargs: float) -> RedisStore:
    """Short backoffs, so reconnects happen within a test."""
    args: dict[str, float] = {"get_timeout_s": 1.0, "min_backoff_s": 0.05, "max_backoff_s": 0.2}
    return RedisStore(url, **(args | kwargs))  # type: ignore[arg-type]


def test_round_trip_with_hiredis_and_misses(server: RedisServer) -> None:
    assert redis.utils.HIREDIS_AVAILABLE  # the pinned parser is installed and used
    store = fast_store(server.url, ttl_s=3600)
    keys = chain(5)
    stored(store, keys[:4])
    assert store.get(keys) == [payload(k) for k in keys[:4]] + [None]
    assert store.contains(keys) == [True] * 4 + [False]
    assert not store.is_cluster
    with server.client() as c:
        assert 0 < c.pttl(keys[0].name) <= 3600 * 1000
    s = store.stats()
    assert (s.num_queries, s.num_hits, s.num_puts, s.num_errors, s.num_timeouts) == (10, 4, 4, 0, 0)
    assert s.bytes_in == s.bytes_out > 4000
    store.close()


def test_a_corrupted_value_is_a_miss_and_is_deleted(server: RedisServer) -> None:
    store = fast_store(server.url)
    keys = chain(3)
    stored(store, keys)
    with server.client() as c:
        c.setrange(keys[1].name, 100, b"\xff\xfe")  # bytes flipped inside the stored frame
        c.set(keys[2].name, b"not a frame")
    assert store.get(keys) == [payload(keys[0]), None, None]
    assert store.flush(30)
    with server.client() as c:
        assert c.exists(keys[1].name, keys[2].name) == 0
    assert store.stats().num_corrupt == 2
    store.close()


def test_an_evicted_key_is_a_miss(tmp_path: Path) -> None:
    server = RedisServer(
        tmp_path / "redis", ["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]
    ).start()
    try:
        store = fast_store(server.url)
        keys = chain(60)
        for i in range(0, 60, 4):  # 60 × 64 KB into 2 MB: Redis evicts the older ones
            stored(store, keys[i : i + 4], 64_000)
        # Redis's LRU is approximate (it samples keys), so which keys go is its choice: ask it
        # which are left, then every one it evicted must be a miss and every one left a hit.
        with server.client() as c:
            left = [bool(c.exists(k.name)) for k in keys]
            assert int(c.info("stats")["evicted_keys"]) > 0
        assert not all(left) and left[-1]
        got = store.get(keys)
        assert [g is not None for g in got] == left
        assert all(g == payload(k, 64_000) for g, k in zip(got, keys) if g is not None)
        store.close()
    finally:
        server.stop()


def test_redis_killed_mid_run_gives_misses_and_drops_then_reconnects(server: RedisServer) -> None:
    store = fast_store(server.url)
    keys = chain(8)
    stored(store, keys[:4])
    server.kill()
    assert store.get(keys[:4]) == [None] * 4  # refused at once: misses, no exception
    assert store.contains(keys[:4]) == [False] * 4
    store.put([(k, payload(k)) for k in keys[4:]])
    assert store.flush(30)
    s = store.stats()
    assert s.num_errors >= 1 and s.num_dropped >= 4 and s.num_puts == 4
    server.start()  # the same port, empty (no persistence)

    def works_again() -> bool:
        store.put([(keys[4], payload(keys[4]))])
        store.flush(30)
        return store.get(keys[4:5]) == [payload(keys[4])]

    wait_until(works_again)
    assert store.get(keys[:4]) == [None] * 4  # lost with the old process: misses, not errors
    store.close()


def test_a_hung_redis_answers_misses_at_the_deadline_and_drops_sets(server: RedisServer) -> None:
    """SIGSTOP: connections stay open and nothing answers. The socket timeout (longer than the
    whole test) would hold a caller that talked to Redis itself; the store's caller waits only
    its get deadline: misses counted as one timeout and no error, while Redis is still stopped
    (a read ended by the socket would count an error)."""
    store = RedisStore(server.url, get_timeout_s=0.2, io_timeout_s=3600, max_pending_bytes=50_000)
    keys = chain(12)
    stored(store, keys[:2])
    server.pause()
    try:
        assert store.get(keys[:2]) == [None, None]
        s = store.stats()
        assert (s.num_timeouts, s.num_errors) == (1, 0)
        # The writer is stuck on the hung server: the bounded queue fills and drops the rest.
        accepted = sum(store.put([(k, payload(k, 10_000))]) for k in keys[2:])
        assert accepted < 10 and store.stats().num_dropped >= 10 - accepted
    finally:
        server.resume()
    assert store.flush(60)
    wait_until(lambda: store.get(keys[:1]) == [payload(keys[0])])
    store.close()


def mget_calls(server: RedisServer) -> int:
    with server.client() as c:
        return int(c.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_a_hung_redis_costs_one_deadline_not_one_per_read(server: RedisServer) -> None:
    """While the first read past its deadline still hangs, later reads answer misses at once and
    never reach Redis: after SIGCONT the server has run the stuck MGET and the first read that
    succeeds, nothing more (counted on the server, not timed; the deadline is long enough that
    the first read surely starts on its reader thread before its caller gives up)."""
    store = RedisStore(server.url, get_timeout_s=2.0, io_timeout_s=60)
    keys = chain(4)
    stored(store, keys)
    before = mget_calls(server)
    server.pause()
    try:
        for _ in range(6):
            assert store.get(keys) == [None] * 4
        assert store.contains(keys) == [False] * 4
        assert store.stats().num_timeouts == 7
    finally:
        server.resume()
    wait_until(lambda: store.get(keys) == [payload(k) for k in keys])
    assert mget_calls(server) - before == 2
    store.close()


def test_out_of_memory_under_noeviction_refuses_stores_and_keeps_reads(tmp_path: Path) -> None:
    """`maxmemory` + `noeviction`: Redis answers OOM to every SET. That is a refused store
    (counted, stores paused), not a lost connection: the keys present stay readable. The long
    backoff makes a store that dropped its connection on OOM read misses throughout."""
    extra = ["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]
    server = RedisServer(tmp_path / "redis", extra).start()
    try:
        store = fast_store(server.url, min_backoff_s=60, max_backoff_s=60, oom_pause_s=600)
        present = chain(10)
        stored(store, present)
        filler = chain(60, salt=1)
        for i in range(0, 60, 4):  # 60 × 64 KB cannot fit in 2 MB
            store.put([(k, payload(k, 64_000)) for k in filler[i : i + 4]])
            assert store.flush(30)
        for _ in range(6):
            assert store.get(present) == [payload(k) for k in present]
        s = store.stats()
        assert s.num_refused > 0 and s.num_errors == 0
        # Memory freed, but the pause holds: a store now is refused without reaching Redis.
        with server.client() as c:
            c.delete(*[k.name for k in filler])
        late = chain(2, salt=2)
        stored(store, late)
        assert store.stats().num_refused == s.num_refused + 2
        with server.client() as c:
            assert c.exists(*[k.name for k in late]) == 0
        assert store.stats().num_errors == 0
        store.close()
    finally:
        server.stop()


@pytest.mark.parametrize("denied", [["-info"], ["-info", "-cluster"]])
def test_an_acl_user_without_info_connects_and_round_trips(
    server: RedisServer, denied: list[str]
) -> None:
    with server.client() as c:
        c.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", *denied)
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis(host="127.0.0.1", port=server.port, username="kv", password="pw").info()
    store = fast_store(
        f"redis://kv:pw@127.0.0.1:{server.port}/0", min_backoff_s=60, max_backoff_s=60
    )
    keys = chain(3)
    stored(store, keys)
    assert store.get(keys) == [payload(k) for k in keys]
    assert not store.is_cluster and store.stats().num_errors == 0
    store.close()


def test_a_cluster_serves_a_chain_segment_with_one_mget_on_one_node(tmp_path: Path) -> None:
    nodes = start_cluster(tmp_path)
    try:
        store = fast_store(nodes[0].url)
        a, b = chain(8, salt=1), chain(8, salt=2)  # two segments of 4 blocks each
        stored(store, a + b)
        assert store.is_cluster
        assert store.get(a + b) == [payload(k) for k in a + b]

        def mget_calls() -> list[int]:
            out = []
            for n in nodes:
                with n.client() as c:
                    out.append(int(c.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)))
            return out

        slots = set()
        with nodes[0].client() as c:
            for k in a[:4]:
                slots.add(c.execute_command("CLUSTER", "KEYSLOT", k.name))
        assert len(slots) == 1  # one segment, one hash slot
        before = mget_calls()
        assert store.get(a[:4]) == [payload(k) for k in a[:4]]
        after = mget_calls()
        assert sum(after) - sum(before) == 1  # one round trip
        nodes[1].kill()  # a master dies mid-run: nothing raises, and what comes back is intact
        got = store.get(a + b)
        assert all(g is None or g == payload(k) for g, k in zip(got, a + b))
        store.close()
    finally:
        for n in nodes:
            n.stop()


def test_bad_urls_and_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RedisStore("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="get_timeout_s"):
        RedisStore("redis://127.0.0.1:1/0", get_timeout_s=0)
    store = RedisStore("valkey://user:secret@127.0.0.1:1/2")
    assert store.where == "127.0.0.1:1/2" and "secret" not in store.where
    assert store.get(chain(2)) == [None, None]  # nothing listens on port 1: misses
    store.close()
