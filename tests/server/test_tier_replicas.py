"""The lower tiers behind `kvtier serve` (architecture.md §Chain): two replica processes on one
real Redis share prefixes (replica B's first request on a prefix A served is a remote hit, in
`usage.prompt_tokens_details.cached_tokens` and on /metrics; once Redis is killed both still
answer with the same tokens), and a server restarted on the same
`--kv-disk-path` finds its blocks (the first request on an old prefix is a disk hit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.bench.procs import stop
from tests.server.conftest import MODEL, wait_until
from tests.server.procs import _start, metric, request, wait_ready
from tests.stores.servers import RedisServer

PROMPT = (
    "You are a careful assistant for a library of Python recipes. Answer in one sentence, cite "
    "the recipe by its number, and never invent a recipe that is not listed below. Recipes: 1. "
    "read a file line by line; 2. parse JSON from a string; 3. sort a list of dicts by a key; 4. "
    "time a function; 5. walk a folder tree. Question: which recipe sorts records?"
)
SERVE = ["serve", "--max-model-len", "512", "--num-device-blocks", "256", "--torch-threads", "1"]
TIERED = ["--num-host-blocks", "64", "--kv-tier-timeout-s", "5"]


def complete(port: int, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, _, raw = request(port, "/v1/completions", body)
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_replica_b_finds_what_replica_a_served_in_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    flags = [*SERVE, *TIERED, "--kv-remote-url", redis_server.url]
    replicas = [_start(flags, tmp_path / f"replica{i}.log") for i in range(2)]
    try:
        wait_ready(replicas, 120)
        a, b = replicas
        first = complete(a.port)
        assert cached(first) == 0
        demoted = 'op="demoted",tier="remote"'
        wait_until(lambda: metric(a.port, "kvtier:kv_tier_blocks_total", demoted) > 0, 30)
        with redis_server.client() as c:  # A's demotions are written (puts are background)
            queued = metric(a.port, "kvtier:kv_tier_blocks_total", demoted)
            wait_until(lambda: c.dbsize() >= queued, 30)
        second = complete(b.port)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert cached(second) > 0
        hits = metric(b.port, "kvtier:prefix_cache_hits_total", 'tier="remote"')
        assert hits == cached(second)
        assert metric(b.port, "kvtier:kv_tier_get_latency_seconds_count", 'tier="remote"') > 0
        redis_server.kill()  # Redis dies: a new prompt's lookups miss, both replicas answer it
        again = PROMPT + " And which one times code?"
        new = [complete(p.port, again)["choices"][0]["text"] for p in replicas]
        assert new[0] == new[1]
        old = [complete(p.port)["choices"][0]["text"] for p in replicas]
        assert old == [first["choices"][0]["text"]] * 2
        assert metric(b.port, "kvtier:kv_tier_errors_total", 'tier="remote"') > 0
    finally:
        stop(replicas)
    for p in replicas:
        assert p.proc.returncode == 0, (p.proc.returncode, p.log.read_text()[-600:])


def test_a_restarted_server_finds_an_old_prefix_on_disk(tmp_path: Path) -> None:
    """`kvtier serve` stopped by SIGTERM closes its engine (queued disk writes finish, the folder
    is unlocked) and exits 0; started again on the same folder, its first request is a disk hit."""
    flags = [*SERVE, *TIERED, "--kv-disk-path", str(tmp_path / "disk")]
    texts, hits = [], []
    for i in range(2):
        proc = _start(flags, tmp_path / f"serve{i}.log")
        try:
            wait_ready([proc], 120)
            resp = complete(proc.port)
            texts.append(resp["choices"][0]["text"])
            hits.append(cached(resp))
            assert metric(proc.port, "kvtier:prefix_cache_hits_total", 'tier="disk"') == hits[-1]
        finally:
            stop([proc])
        assert proc.proc.returncode == 0, (proc.proc.returncode, proc.log.read_text()[-600:])
    assert texts[0] == texts[1]
    assert hits[0] == 0 and hits[1] > 0
