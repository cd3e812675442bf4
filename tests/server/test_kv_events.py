"""KV cache events over real ZMQ sockets, read as vLLM's consumers read them.

The subscriber below decodes with its own msgspec structs, written from vLLM 0.32's format
(`vllm/distributed/kv_events.py`) as strictly as vllm-router 0.1.17 admits it (unknown fields and
missing required ones refused), and keeps a prefix index the way the router's kv_aware policy
does: each block by sha256 of its own token ids (u32 little-endian), placed under its parent's
engine hash (a store whose parent it never saw is skipped), per medium. So a test that matches a
prompt's blocks here shows the router would match them too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvtier.kv.events import BlockStored as KVStored
from kvtier.server.kv_events import KVEventEncoder, KVEventsConfig
from kvtier.server.kv_publisher import END_SEQ, KVEventPublisher
from tests.server.conftest import ServerHandle, start_server, stop_server, wait_until
from tests.stores.servers import RedisServer

Hash = bytes | int


class Stored(msgspec.Struct, tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


def local_hash(tokens: list[int]) -> bytes:
    return hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens)).digest()


class RouterIndex:
    """The prefix index vllm-router's kv_aware keeps from the events (see the module doc), one
    shard per KV-cache group as the router's (it queries group 0, the full-attention one)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (group, engine hash) -> the local hashes from the root to it
        self.path: dict[tuple[int, Hash], tuple[bytes, ...]] = {}
        self.held: dict[tuple[int, str], set[Hash]] = defaultdict(set)  # (group, tier) -> hashes

    @staticmethod
    def tier(medium: str | None, ownership: str | None) -> str:
        return "external" if ownership else (medium or "GPU")

    def apply(self, batch: Batch) -> None:
        for e in batch.events:
            if isinstance(e, Cleared):
                self.held.clear()
            elif isinstance(e, Removed):
                key = (e.group_idx or 0, self.tier(e.medium, e.ownership))
                self.held[key].difference_update(e.block_hashes)
            else:
                self._store(e)

    def _store(self, e: Stored) -> None:
        assert e.block_size == self.block_size
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        assert e.lora_id is None and e.lora_name is None and not e.extra_keys
        g = e.group_idx or 0
        parent = e.parent_block_hash
        if parent is not None and (g, parent) not in self.path:
            return  # the router skips an unanchored store
        path = () if parent is None else self.path[(g, parent)]
        for i, h in enumerate(e.block_hashes):
            toks = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
            path = (*path, local_hash(toks))
            self.path[(g, h)] = path
            self.held[(g, self.tier(e.medium, e.ownership))].add(h)

    def match(self, tokens: list[int], tier: str, group: int = 0) -> int:
        """Blocks of `tokens`' prefix held in `tier`."""
        held_paths = {self.path[(group, h)] for h in self.held[(group, tier)]}
        n, path = 0, ()
        while (n + 1) * self.block_size <= len(tokens):
            path = (*path, local_hash(tokens[n * self.block_size : (n + 1) * self.block_size]))
            if path not in held_paths:
                break
            n += 1
        return n


def connect_endpoint(bound: str) -> str:
    return bound.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class Subscriber:
    """A SUB socket on the publisher and a DEALER on its replay socket, as the router opens."""

    def __init__(self, endpoint: str, replay: str | None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(connect_endpoint(endpoint))
        self.replay_endpoint = None if replay is None else connect_endpoint(replay)

    def recv(self, timeout_ms: int) -> tuple[bytes, int, Batch] | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big", signed=True), DECODER.decode(payload)

    def replay(self, start: int) -> list[tuple[int, Batch]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(30_000), "no replay answer"
            empty, _topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                break
            out.append((int.from_bytes(seq, "big", signed=True), DECODER.decode(payload)))
        dealer.close(linger=0)
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


# ---- the config ----------------------------------------------------------------------------------


def test_config_is_vllms_json_with_its_defaults():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert cfg.publisher == "zmq" and cfg.publishes
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.topic) == ("tcp://*:5557", None, "")
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (10_000, 100_000, 100_000)
    assert not KVEventsConfig.from_json("{}").publishes  # publisher "null" unless enabled
    off = '{"enable_kv_cache_events": true, "publisher": "null"}'
    assert not KVEventsConfig.from_json(off).publishes


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("not json", "JSON object"),
        ("[1]", "JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"hwm": true}', "hwm"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
    ],
)
def test_config_refuses_bad_fields_naming_them(text: str, names: str):
    with pytest.raises(ValueError, match=names):
        KVEventsConfig.from_json(text)


def test_a_port_in_use_is_a_start_error_naming_the_flag():
    first = KVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"), KVEventEncoder()
    )
    first.start()
    try:
        taken = first.endpoint.replace("0.0.0.0", "*")
        second = KVEventPublisher(
            KVEventsConfig(enable_kv_cache_events=True, endpoint=taken), KVEventEncoder()
        )
        with pytest.raises(ValueError, match="--kv-events-config"):
            second.start()
    finally:
        first.close()


def test_the_start_line_says_whether_the_endpoint_was_bound_or_connected_to(caplog):
    """An address without a wildcard host is connected to (vLLM's rule), not bound: a router
    pointed at it then hears nothing, so the log says which happened."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        caplog.set_level(logging.INFO, logger="kvtier.server")
        for endpoint, said in (
            ("tcp://*:0", "bound at"),
            (f"tcp://127.0.0.1:{port}", "connecting to"),
        ):
            pub = KVEventPublisher(
                KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint), KVEventEncoder()
            )
            pub.start()
            pub.close()
            line = [
                r.getMessage() for r in caplog.records if "KV cache events: PUB" in r.getMessage()
            ][-1]
            assert said in line, line
    finally:
        sub.close(linger=0)
        ctx.term()


# ---- the publisher -------------------------------------------------------------------------------


def _events(n: int) -> list[KVStored]:
    return [KVStored([bytes([i]) * 32], None, [i] * 4, 4, 0, "device") for i in range(n)]


def test_a_full_queue_drops_and_counts_without_blocking_and_leaves_a_sequence_gap():
    """Nothing drains the queue before `start`: the engine's publishes return at once, past
    max_queue_size they are dropped and counted, and their sequence numbers stay spent."""
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        max_queue_size=2,
    )
    pub = KVEventPublisher(cfg, KVEventEncoder())
    for i in range(5):
        pub.publish(_events(1 + i))
    stats = pub.stats()
    assert (stats.num_dropped_batches, stats.num_dropped_events) == (3, 3 + 4 + 5)
    pub.start()
    try:
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            wait_until(lambda: pub.stats().num_batches == 2, 30)
            assert [seq for seq, _ in sub.replay(0)] == [0, 1]  # 2, 3, 4 were dropped
            got = None
            while got is None or got[1] != 5:  # the slow joiner may miss the first sends
                pub.publish(_events(1))
                got = sub.recv(200)
                while got is not None and got[1] < 5:
                    got = sub.recv(200)
            assert got[0] == b"" and got[2].data_parallel_rank == 0
        finally:
            sub.close()
    finally:
        pub.close()


def test_replay_resends_the_buffered_batches_from_a_sequence_then_ends():
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=3,
        topic="kv",
    )
    pub = KVEventPublisher(cfg, KVEventEncoder())
    pub.start()
    try:
        for i in range(5):
            pub.publish(_events(i + 1))
        wait_until(lambda: pub.stats().num_batches == 5, 30)
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, b"kv")
        try:
            replayed = sub.replay(1)
            assert [seq for seq, _ in replayed] == [2, 3, 4]  # only the last 3 are kept
            assert [len(b.events) for _, b in replayed] == [3, 4, 5]
            assert sub.replay(9) == []
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_step_of_more_events_than_a_consumer_takes_is_split_into_batches():
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    pub = KVEventPublisher(cfg, KVEventEncoder())
    pub.start()
    try:
        pub.publish(_events(250) * 20)  # 5,000 events: vllm-router refuses > 4,096 per batch
        wait_until(lambda: pub.stats().num_batches == 2, 30)
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            assert [len(b.events) for _, b in sub.replay(0)] == [4096, 904]
        finally:
            sub.close()
    finally:
        pub.close()


# ---- a server's tiers ----------------------------------------------------------------------------

BS = 16


def _post(handle: ServerHandle, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return handle.post(path, body)


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 900 for i in range(n)]


def test_every_tier_is_announced_as_vllm_router_reads_it(tmp_path: Path, redis_server: RedisServer):
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    handle = start_server(
        kv_events=cfg,
        max_model_len=64,
        num_device_blocks=16,  # 15 usable: a 40-token prompt takes 3 in each of the 3 groups
        num_host_blocks=64,
        kv_disk_path=str(tmp_path / "disk"),
        kv_remote_url=redis_server.url,
        block_size=BS,
        kv_tier_timeout_s=5.0,
    )
    publisher = handle.engine.kv_publisher  # type: ignore[attr-defined]
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    index = RouterIndex(BS)
    seen: list[tuple[int, Batch]] = []

    def catch_up() -> None:
        for seq, batch in sub.replay(len(seen)):
            assert seq == len(seen)  # every sequence number, in order, none dropped
            seen.append((seq, batch))
            index.apply(batch)

    def flushed(fn: Any) -> Any:
        return handle.engine.call(lambda e: (e.flush_tiers(30), fn(e))[1])

    try:
        a = _prompt(1)
        status, _ = _post(handle, "/v1/completions", {"prompt": a, "max_tokens": 1})
        assert status == 200
        flushed(lambda e: None)

        def tiers_hold_a() -> bool:
            catch_up()
            return all(index.match(a, t) == 2 for t in ("GPU", "CPU", "STORAGE", "external"))

        wait_until(tiers_hold_a, 60)
        stored = [e for _, b in seen for e in b.events if isinstance(e, Stored)]
        remote = [e for e in stored if e.ownership]
        assert remote and {(e.medium, e.locality) for e in remote} == {("STORAGE", "REMOTE")}
        assert {e.ownership for e in remote} == {redis_server.url.removeprefix("redis://")}
        assert {e.group_idx for e in stored} == {0, 1, 2}  # the embedded model's 3 groups

        # a live subscriber sees the same batches (the first sends may precede its connection)
        live = None
        while live is None:
            _post(handle, "/v1/completions", {"prompt": _prompt(99, 20), "max_tokens": 1})
            live = sub.recv(2000)
        _topic, seq, batch = live
        catch_up()
        assert seen[seq][1] == batch

        # the device evicts a's blocks; the host, disk and Redis keep them
        for s in (2, 3, 4):
            body = {"prompt": _prompt(s), "max_tokens": 1}
            assert _post(handle, "/v1/completions", body)[0] == 200
        flushed(lambda e: None)
        wait_until(lambda: (catch_up(), index.match(a, "GPU") == 0)[1], 60)
        assert index.match(a, "CPU") == 2 and index.match(a, "STORAGE") == 2
        removed = [e for _, b in seen for e in b.events if isinstance(e, Removed)]
        assert {e.medium for e in removed} >= {"GPU"}

        wait_until(lambda: flushed(lambda e: e.reset_prefix_cache()), 60)
        wait_until(
            lambda: (catch_up(), any(isinstance(e, Cleared) for e in seen[-1][1].events))[1], 60
        )
        assert all(index.match(a, t) == 0 for t in ("GPU", "CPU", "STORAGE", "external"))
        seqs = [seq for seq, _ in seen]
        assert seqs == list(range(len(seqs)))

        def counted() -> bool:  # the metrics follow the publisher at the loop's next update
            m = handle.metrics()
            sent = m[("kvtier:kv_event_batches_total", (("op", "sent"),))]
            return (
                sent >= len(seqs)
                and m[("kvtier:kv_event_batches_total", (("op", "dropped"),))] == 0
            )

        wait_until(counted, 30)
    finally:
        sub.close()
        stop_server(handle)


def test_disk_evictions_are_announced_as_removed(tmp_path: Path):
    """A disk tier of six block files: the first prompt's twelve blocks fill it (the rest are
    dropped), the second's evict them. Both are BlockRemoved with medium STORAGE, so what the
    events leave held is what the disk holds."""
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    handle = start_server(
        kv_events=cfg,
        max_model_len=128,
        num_device_blocks=64,
        num_host_blocks=64,
        kv_disk_path=str(tmp_path / "disk"),
        kv_disk_size=6 * 8400 / (1 << 30),  # six blocks of the embedded model (8 KiB + frame)
        block_size=BS,
    )
    publisher = handle.engine.kv_publisher  # type: ignore[attr-defined]
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    a, b = _prompt(5, 66), _prompt(6, 66)  # 4 full blocks in each of 3 groups: 12 files each

    def disk(e: Any) -> tuple[int, int]:
        e.flush_tiers(30)
        store = e.tier_chain.lowers[0].store
        return int(store.num_blocks), store.stats().num_evicted

    def consistent(evicted: bool) -> bool:
        on_disk, num_evicted = handle.engine.call(disk)
        index = RouterIndex(BS)
        for _, batch in sub.replay(0):
            index.apply(batch)
        held = sum(len(v) for (_, tier), v in index.held.items() if tier == "STORAGE")
        return (
            (num_evicted > 0) == evicted and 0 < on_disk == held and index.match(a, "STORAGE") < 4
        )

    try:
        assert _post(handle, "/v1/completions", {"prompt": a, "max_tokens": 1})[0] == 200
        wait_until(lambda: consistent(evicted=False), 60)  # the 6 files that fit
        assert _post(handle, "/v1/completions", {"prompt": b, "max_tokens": 1})[0] == 200
        wait_until(lambda: consistent(evicted=True), 60)
    finally:
        sub.close()
        stop_server(handle)


def test_engine_process_publishes_from_its_own_process(tmp_path: Path):
    """`kvtier serve`'s default host: the publisher lives beside the engine in its process."""
    port_probe = zmq.Context.instance().socket(zmq.PUB)
    port = port_probe.bind_to_random_port("tcp://127.0.0.1")
    port_probe.close(linger=0)
    cfg = KVEventsConfig.from_json(
        json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    )
    handle = start_server(
        kv_events=cfg, engine_process=True, max_model_len=64, num_device_blocks=64, block_size=BS
    )
    sub = Subscriber(f"tcp://127.0.0.1:{port}", None)
    index = RouterIndex(BS)
    try:
        got = None
        seed = 10
        while got is None:  # the slow joiner misses what precedes its connection
            seed += 1
            body = {"prompt": _prompt(seed, 34), "max_tokens": 1}
            assert _post(handle, "/v1/completions", body)[0] == 200
            got = sub.recv(2000)
        index.apply(got[2])
        q = _prompt(0, 34)
        assert _post(handle, "/v1/completions", {"prompt": q, "max_tokens": 1})[0] == 200

        def matched() -> bool:
            got = sub.recv(100)
            if got is not None:
                index.apply(got[2])
            return index.match(q, "GPU") == 2

        wait_until(matched, 60)
    finally:
        sub.close()
        stop_server(handle)
