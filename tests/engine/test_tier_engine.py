"""The tier chain in the engine (architecture.md §Chain): with a device pool and a host tier too
small to keep the prefixes, later rounds find them on disk or in a real Redis — and every
completion equals the run with the tiers off, on the sim device with the sanitizer raising and
NaN poison in recycled blocks; pools and pins end empty. Failure injection (Redis killed mid-run
or hung, disk files truncated, a tiny disk limit) only turns hits into recomputation. A second
engine on the same disk folder finds the first one's blocks."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.stats import EngineStats
from kvtier.model.testing import write_tiny_model
from kvtier.offload.chain import TierStats
from kvtier.stores import redis_store
from tests.stores.servers import RedisServer, start_cluster, wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BASE: dict[str, Any] = {
    "max_model_len": 64,
    "block_size": 4,
    "max_num_batched_tokens": 32,
    "device": "sim",
    "sanitize": True,
    "poison": True,
    "check_integrity": True,
    # reads past their deadline recompute (same tokens, no lower-tier hit); the timeout tests set
    # their own. Assertions on a tier's use read promoted blocks: a promoted block that the
    # device serves before any admission loads it from the host credits no hit (architecture.md
    # §Chain)
    "kv_tier_timeout_s": 30.0,
}
SMALL = {"num_device_blocks": 40, "num_host_blocks": 20}  # neither keeps 16 prompts' prefixes
WINDOWED = {"num_device_blocks": 80, "num_host_blocks": 24}  # gemma3 needs 65 device blocks


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama-tiers"), "llama")


HUNG_S = 3600.0  # longer than any test: a read of a SIGSTOPped Redis ends only by SIGCONT


class _HungReadsWait(redis_store.RedisStore):
    """A real `RedisStore` whose socket timeout outlasts the test, so a read of a paused Redis
    is in flight until the test resumes it, and only a deadline can end a wait before that
    (the default socket timeout would end it as a miss whenever a loaded box stalls the test)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **(kwargs | {"io_timeout_s": HUNG_S}))


@pytest.fixture
def hung_reads_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine built in the test gets `_HungReadsWait` for its remote tier."""
    monkeypatch.setattr(redis_store, "RedisStore", _HungReadsWait)


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 16-token system prefix, then their own 8 to 24 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(16)]
    return [system + [rng.randrange(3, 300) for _ in range(rng.randrange(8, 24))] for _ in range(n)]


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def rounds(llm: LLM, n: int = 3) -> list[list[list[int]]]:
    """`n` rounds of the same prompts; the lower tiers' writes land between rounds (so later
    rounds can hit them: the tokens would be the same without, only the hits would vary)."""
    out = []
    for _ in range(n):
        out.append(generate(llm, prompts()))
        assert llm.engine.flush_tiers(30)
    return out


def assert_clean(llm: LLM) -> EngineStats:
    """No hazards; device and host pools and pins back to empty; integrity holds."""
    stats = llm.engine.stats()
    assert stats.num_hazards == 0
    for pool in (stats.device, stats.host):
        assert pool is not None
        assert pool.num_used == 0 and pool.num_load_pins == 0 and pool.num_store_pins == 0
        assert pool.num_quarantined_refs == 0
    llm.engine.check_integrity()
    return stats


def fill_tier(model: Path, expected: list[list[list[int]]], **tier: Any) -> None:
    """Run one round through an engine with `tier` (its tokens must be `expected`), then close it:
    closing flushes its disk and Redis writes and unlocks a disk folder."""
    first = LLM(str(model), **BASE, **SMALL, **tier)
    try:
        assert rounds(first, 1) == expected
    finally:
        first.engine.close()


def tier(stats: EngineStats, name: str) -> TierStats:
    t = stats.tier(name)
    assert t is not None
    return t


@pytest.fixture(scope="module")
def reference(llama: Path) -> list[list[list[int]]]:
    llm = LLM(str(llama), **BASE, num_device_blocks=400)
    try:
        return rounds(llm)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_disk_tier_serves_later_rounds_with_the_same_tokens(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path, depth: int
) -> None:
    sched = {"async_scheduling": depth > 1, "async_depth": depth}
    llm = LLM(str(llama), **BASE, **SMALL, **sched, kv_disk_path=str(tmp_path / "disk"))
    try:
        assert rounds(llm) == reference
        stats = assert_clean(llm)
        disk = tier(stats, "disk")
        assert disk.metrics.num_promoted_blocks > 0 and disk.store.num_hits > 0
        assert disk.store.num_puts > 0 and disk.store.num_errors == 0
        assert stats.tier("remote") is None
    finally:
        llm.engine.close()


def test_a_windowed_model_restores_whole_boundaries_from_disk(gemma3: Path, tmp_path: Path) -> None:
    """H6 on every tier: the window group is fetched with the full group, to one boundary."""
    ref = LLM(str(gemma3), **BASE, num_device_blocks=400)
    llm = LLM(str(gemma3), **BASE, **WINDOWED, kv_disk_path=str(tmp_path / "disk"))
    try:
        assert rounds(llm) == rounds(ref)
        assert tier(assert_clean(llm), "disk").metrics.num_promoted_blocks > 0
    finally:
        llm.engine.close()
        ref.engine.close()


def test_redis_tier_serves_later_rounds_with_the_same_tokens(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    llm = LLM(str(llama), **BASE, **SMALL, kv_remote_url=redis_server.url)
    try:
        assert rounds(llm) == reference
        remote = tier(assert_clean(llm), "remote")
        assert remote.metrics.num_promoted_blocks > 0 and remote.store.num_hits > 0
        with redis_server.client() as c:
            assert c.dbsize() > 0
    finally:
        llm.engine.close()


def test_a_redis_cluster_serves_later_rounds_with_the_same_tokens(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path
) -> None:
    """The remote tier on a three-master Cluster (keys of one chain segment on one node)."""
    nodes = start_cluster(tmp_path / "cluster")
    llm = None
    try:
        llm = LLM(str(llama), **BASE, **SMALL, kv_remote_url=nodes[0].url)
        assert rounds(llm) == reference
        remote = tier(assert_clean(llm), "remote")
        assert remote.metrics.num_promoted_blocks > 0 and remote.store.num_errors == 0
        sizes = []
        for n in nodes:
            with n.client() as c:
                sizes.append(int(c.dbsize()))
        # these chains are shorter than one 64-block segment: all on one shard, by design
        assert sorted(sizes)[-1] == sum(sizes) > 0
    finally:
        if llm is not None:
            llm.engine.close()
        for n in nodes:
            n.stop()


def test_disk_then_remote_promotes_remote_hits_to_disk(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path, redis_server: RedisServer
) -> None:
    """A second engine with an empty disk and the first one's Redis: its hits come from the
    remote tier, and what it read there is written to its disk too (promotion)."""
    fill_tier(llama, reference[:1], kv_remote_url=redis_server.url)
    llm = LLM(
        str(llama),
        **BASE,
        **SMALL,
        kv_disk_path=str(tmp_path / "disk"),
        kv_remote_url=redis_server.url,
    )
    try:
        assert rounds(llm, 1) == reference[:1]
        stats = assert_clean(llm)
        remote, disk = tier(stats, "remote"), tier(stats, "disk")
        assert remote.metrics.num_promoted_blocks > 0
        assert disk.store.num_puts >= remote.metrics.num_promoted_blocks > 0
    finally:
        llm.engine.close()


def test_redis_killed_mid_run_loses_no_request(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    llm = LLM(
        str(llama), **(BASE | {"kv_tier_timeout_s": 0.2}), **SMALL, kv_remote_url=redis_server.url
    )
    try:
        assert rounds(llm, 1) == reference[:1]
        engine = llm.engine
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, GREEDY)
        steps, done = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.result is not None:
                    done[out.req_id] = list(out.result.token_ids)
            steps += 1
            if steps == 3:
                redis_server.kill()
        assert [done[f"r{i}"] for i in range(len(done))] == reference[1]
        assert generate(llm, prompts()) == reference[2]
        assert_clean(llm)
    finally:
        llm.engine.close()


def test_corrupted_values_and_a_restarted_redis_change_no_token(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """Every value overwritten with garbage: misses (counted corrupt), recomputed. Redis
    restarted empty on its port: misses, then the tier reconnects and stores again."""
    llm = LLM(str(llama), **BASE, **SMALL, kv_remote_url=redis_server.url)
    try:
        assert rounds(llm, 1) == reference[:1]
        with redis_server.client() as c:
            keys = c.keys("*")
            assert keys
            for key in keys:
                c.set(key, b"not a frame")
        assert generate(llm, prompts()) == reference[1]
        assert tier(llm.engine.stats(), "remote").store.num_corrupt > 0
        redis_server.kill()
        redis_server.start()  # the same port, empty
        assert generate(llm, prompts()) == reference[2]
        seeds = iter(range(1, 100))

        def stores_again() -> bool:  # a new prompt's blocks reach the new server
            generate(llm, prompts(2, next(seeds)))
            llm.engine.flush_tiers(30)
            with redis_server.client() as c:
                return int(c.dbsize()) > 0

        wait_until(stores_again, 60)
        assert_clean(llm)
    finally:
        llm.engine.close()


@pytest.mark.usefixtures("hung_reads_wait")
def test_a_hung_redis_times_out_to_recompute(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """SIGSTOP: the server holds its connections and answers nothing (no read ends before
    SIGCONT); lookups stop waiting at the deadline and recompute, with the same tokens."""
    llm = LLM(
        str(llama), **(BASE | {"kv_tier_timeout_s": 0.05}), **SMALL, kv_remote_url=redis_server.url
    )
    try:
        assert rounds(llm, 1) == reference[:1]
        redis_server.pause()
        try:
            assert generate(llm, prompts()) == reference[1]
        finally:
            redis_server.resume()
        stats = assert_clean(llm)
        assert llm.engine.tier_chain is not None
        # The store's read deadline is the lookup's: whichever ends the wait first counts it.
        timeouts = llm.engine.tier_chain.metrics.num_fetch_timeouts
        assert timeouts + tier(stats, "remote").store.num_timeouts > 0
    finally:
        llm.engine.close()


def test_remote_keys_expire_after_the_ttl_flag_and_reads_wait_the_tier_timeout(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """--kv-remote-ttl-s reaches every key (`volatile-*` policies can evict them); one Redis read
    waits --kv-tier-timeout-s, never a multiple of it."""
    llm = LLM(
        str(llama),
        **(BASE | {"kv_tier_timeout_s": 0.25}),
        **SMALL,
        kv_remote_url=redis_server.url,
        kv_remote_ttl_s=600,
    )
    try:
        assert rounds(llm, 1) == reference[:1]
        chain = llm.engine.tier_chain
        assert chain is not None
        assert [getattr(t.store, "get_timeout_s", None) for t in chain.lowers] == [0.25]
        with redis_server.client() as c:
            keys = c.keys("*")
            assert keys
            assert all(0 < c.ttl(k) <= 600 for k in keys)
    finally:
        llm.engine.close()


@pytest.mark.usefixtures("hung_reads_wait")
def test_a_request_waiting_on_a_lower_tier_runs_no_empty_steps(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """While the only request waits for a hung Redis, the engine waits for the I/O instead of
    stepping empty forwards (each one modelled device time on the sim, a wasted forward on a
    real device): the run takes the steps its tokens need."""
    fill_tier(llama, reference[:1], kv_remote_url=redis_server.url)
    llm = LLM(
        str(llama), **(BASE | {"kv_tier_timeout_s": 0.2}), **SMALL, kv_remote_url=redis_server.url
    )
    redis_server.pause()
    try:
        assert generate(llm, prompts()[:1]) == reference[0][:1]
        # one prefill (the prompt fits one step's budget), a step per further token, the step
        # whose lookup starts the read and one completing the last host stores (it took 739
        # steps when the engine stepped empty forwards while the read waited)
        assert llm.engine.queue.num_steps <= 3 + GREEDY.max_tokens
        chain = llm.engine.tier_chain
        assert chain is not None
        # the store's read deadline is the lookup's own: either may end the one wait
        remote = tier(llm.engine.stats(), "remote").store.num_timeouts
        assert (
            chain.metrics.num_fetch_timeouts <= 1 and chain.metrics.num_fetch_timeouts + remote >= 1
        )
    finally:
        redis_server.resume()
        llm.engine.close()


def test_an_orphaned_read_past_its_deadline_runs_no_empty_steps(
    llama: Path, redis_server: RedisServer
) -> None:
    """Issue 41's busy spin (architecture.md §Progress): `gone`'s read of a hung Redis is
    orphaned by an abort and passes its deadline; while `b` then waits on a read of its own,
    every `step()` scheduled an empty step (hundreds in b's wait) instead of waiting for b's
    read. Now the steps are the ones b's tokens need."""
    rng = random.Random(7)
    batch = [[rng.randrange(3, 300) for _ in range(20)] for _ in range(2)]  # no common block
    timeout = 0.5  # Redis reads end as misses after 4 × this: after b's deadline
    kwargs = BASE | SMALL | {"kv_tier_timeout_s": timeout, "kv_remote_url": redis_server.url}
    first = LLM(str(llama), **kwargs)
    try:
        expected = generate(first, batch)
    finally:
        first.engine.close()  # flushes its Redis writes
    llm = LLM(str(llama), **kwargs)
    engine = llm.engine
    redis_server.pause()
    try:
        engine.add_request("gone", batch[0], GREEDY)
        assert engine.step() == []  # its read starts
        assert engine.abort("gone") is not None
        time.sleep(1.5 * timeout)  # the orphaned read passes its deadline, still hung
        before = engine.queue.num_steps
        engine.add_request("b", batch[1], GREEDY)
        done: dict[str, list[int]] = {}
        while "b" not in done:
            done |= {o.req_id: o.result.token_ids for o in engine.step() if o.result}
        # the step whose lookup starts b's read, one prefill, a step per further token, and
        # one for the last host stores; each step() meanwhile waited for b's read
        assert engine.queue.num_steps - before <= 3 + GREEDY.max_tokens
    finally:
        redis_server.resume()
    assert done["b"] == expected[1]
    engine.drain()
    engine.close()


@pytest.mark.usefixtures("hung_reads_wait")
def test_a_step_never_blocks_on_a_lower_tier_read(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """A request waits for a hung Redis (its read and deadline outlast the test, until SIGCONT):
    `step()` returns at once with nothing to do (the caller — the server's loop —
    stays free to take new requests), a request that needs no read runs meanwhile, and the
    waiting one finishes with the same tokens."""
    fill_tier(llama, reference[:1], kv_remote_url=redis_server.url)
    llm = LLM(
        str(llama),
        **(BASE | {"kv_tier_timeout_s": HUNG_S}),
        **SMALL,
        kv_remote_url=redis_server.url,
    )
    engine, chain = llm.engine, llm.engine.tier_chain
    assert chain is not None
    redis_server.pause()
    try:
        engine.add_request("blocked", prompts()[0], GREEDY)
        for _ in range(3):  # it blocked for the whole read (until the socket timeout) here
            assert engine.step() == []
        assert chain.waiting_on_io() == {"blocked"}
        engine.add_request("free", [5, 6, 7], GREEDY)  # too short to look below the host
        done: dict[str, list[int]] = {}
        while "free" not in done:
            done |= {o.req_id: o.result.token_ids for o in engine.step() if o.result}
    finally:
        redis_server.resume()
    while engine.has_unfinished_requests():
        done |= {o.req_id: o.result.token_ids for o in engine.step() if o.result}
    assert list(done["blocked"]) == reference[0][0]
    assert_clean(llm)
    engine.close()


@pytest.mark.usefixtures("hung_reads_wait")
def test_a_request_aborted_while_its_read_is_in_flight_leaks_nothing(
    llama: Path, reference: list[list[list[int]]], redis_server: RedisServer
) -> None:
    """Aborted while it waits for Redis: its read still lands and is staged for whoever asks
    next; pools and pins end empty and the next request runs with the same tokens."""
    fill_tier(llama, reference[:1], kv_remote_url=redis_server.url)
    llm = LLM(
        str(llama),
        **(BASE | {"kv_tier_timeout_s": HUNG_S}),
        **SMALL,
        kv_remote_url=redis_server.url,
    )
    engine, chain = llm.engine, llm.engine.tier_chain
    assert chain is not None
    redis_server.pause()
    try:
        engine.add_request("gone", prompts()[0], GREEDY)
        assert engine.step() == [] and chain.waiting_on_io() == {"gone"}
        assert engine.abort("gone") is not None
        assert chain.waiting_on_io() == set()
    finally:
        redis_server.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert generate(llm, prompts()[:2]) == reference[0][:2]
    assert_clean(llm)
    engine.close()


def test_truncated_disk_files_are_misses(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path
) -> None:
    folder = tmp_path / "disk"
    llm = LLM(str(llama), **BASE, **SMALL, kv_disk_path=str(folder))
    try:
        assert rounds(llm, 1) == reference[:1]
        files = sorted(folder.rglob("*.kvb"))
        assert files
        for f in files:
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
        assert rounds(llm, 2) == reference[1:]
        disk = tier(assert_clean(llm), "disk")
        assert disk.store.num_corrupt > 0
    finally:
        llm.engine.close()


def test_a_tiny_disk_limit_holds_and_changes_no_token(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path
) -> None:
    limit_gib = 64 * 1024 / (1 << 30)  # 64 KiB: a handful of blocks
    folder = tmp_path / "disk"
    llm = LLM(str(llama), **BASE, **SMALL, kv_disk_path=str(folder), kv_disk_size=limit_gib)
    try:
        assert rounds(llm) == reference
        assert_clean(llm)
        assert sum(f.stat().st_size for f in folder.rglob("*.kvb")) <= 64 * 1024
    finally:
        llm.engine.close()


def test_a_restarted_engine_finds_its_blocks_on_disk(
    llama: Path, reference: list[list[list[int]]], tmp_path: Path
) -> None:
    folder = str(tmp_path / "disk")
    fill_tier(llama, reference[:1], kv_disk_path=folder)
    second = LLM(str(llama), **BASE, **SMALL, kv_disk_path=folder)
    try:
        out = second.generate([{"prompt_token_ids": prompts()[0]}], GREEDY, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == reference[0][0]
        assert out[0].num_cached_tokens > 0
        assert tier(assert_clean(second), "disk").metrics.num_hit_tokens > 0
    finally:
        second.engine.close()


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"kv_disk_path": "/tmp/x"}, ["--kv-disk-path", "--num-host-blocks"]),
        ({"kv_disk_path": "", "num_host_blocks": 8}, ["--kv-disk-path"]),
        ({"kv_disk_size": 1.0, "num_host_blocks": 8}, ["--kv-disk-size", "--kv-disk-path"]),
        ({"kv_disk_path": "/tmp/x", "kv_disk_size": -1.0, "num_host_blocks": 8}, ["GiB"]),
        ({"kv_remote_url": "http://h:1", "num_host_blocks": 8}, ["--kv-remote-url", "redis://"]),
        (
            {
                "kv_remote_url": "redis://h:1/0",
                "num_host_blocks": 8,
                "prefix_caching_hash_algo": "xxhash",
            },
            ["--prefix-caching-hash-algo", "sha256"],
        ),
        (
            {"kv_disk_path": "/tmp/x", "num_host_blocks": 8, "kv_offload_store_mode": "lazy"},
            ["--kv-offload-store-mode", "eager"],
        ),
        ({"kv_tier_timeout_s": 0.0}, ["--kv-tier-timeout-s"]),
        ({"kv_remote_ttl_s": 60.0, "num_host_blocks": 8}, ["--kv-remote-ttl-s", "--kv-remote-url"]),
        (
            {"kv_remote_url": "redis://h:1/0", "num_host_blocks": 8, "kv_remote_ttl_s": 0.0},
            ["--kv-remote-ttl-s", "positive"],
        ),
    ],
)
def test_bad_tier_flags_name_the_flag_and_the_fix(kwargs: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        CacheConfig(**kwargs)
    for name in names:
        assert name in str(err.value)


def test_a_bad_redis_url_is_refused_when_the_engine_starts(llama: Path) -> None:
    with pytest.raises(ValueError, match="--kv-remote-url"):
        LLM(str(llama), **BASE, **SMALL, kv_remote_url="redis://127.0.0.1:notaport/0")


def test_a_hybrid_restores_its_state_and_attention_from_disk(tmp_path: Path) -> None:
    """State groups on the lower tiers: a restarted engine loads a Falcon-H1's Mamba snapshot and
    its attention blocks from disk, to one boundary, and continues with the same tokens."""
    falcon = write_tiny_model(tmp_path / "falcon-h1", "falcon_h1")
    ref = LLM(str(falcon), **BASE, num_device_blocks=400)
    try:
        reference = rounds(ref, 1)
    finally:
        ref.engine.close()
    folder = str(tmp_path / "disk")
    fill_tier(falcon, reference, kv_disk_path=folder)
    second = LLM(str(falcon), **BASE, **SMALL, kv_disk_path=folder)
    try:
        assert rounds(second, 1) == reference
        stats = assert_clean(second)
        disk = tier(stats, "disk")
        assert disk.metrics.num_promoted_blocks > 0 and disk.store.num_hits > 0
    finally:
        second.engine.close()
