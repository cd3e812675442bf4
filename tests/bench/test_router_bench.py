"""`kvtier bench router` for real: it starts a redis-server, two `kvtier serve` replicas and
vllm-router, runs the workload through the router, reads the tiers' hits from the replicas and the
requests each one served, and stops every process it started."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench import router


def _args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router.add_arguments(parser)
    # the embedded model: its prefill is ~free, so a run takes seconds
    base = ["--out", str(tmp_path / "router.json"), "--model", "kvtier-default"]
    base += ["--request-rate", "inf"]  # every conversation at once: no seconds between starts
    return parser.parse_args([*base, *flags])


def _children() -> set[str]:
    """This process's children (their pid and command), `ps` itself left out."""
    ps = ["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())]
    lines = subprocess.run(ps, capture_output=True, text=True).stdout.splitlines()
    return {line.strip() for line in lines if line.split()[-1] != "ps"}


def test_a_session_policy_keeps_each_conversation_on_one_replica(tmp_path: Path) -> None:
    """consistent_hash keys on the X-Session-ID the bench sends per conversation: every round
    after the first finds its history on the replica it ran on (device hits), every request is
    served by one replica, and nothing the bench started is left running."""
    before = _children()
    args = _args(tmp_path, "--policies", "consistent_hash", "--num-prompts", "4")
    args.num_rounds, args.prefix_len, args.max_concurrency = 2, 64, 4
    assert router.run(args) == 0
    assert _children() <= before
    res = json.loads((tmp_path / "router.json").read_text())
    (only,) = res["policies"]
    s = only["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert sum(only["served"].values()) == 8
    assert set(only["served"]) == {"replica0", "replica1"}
    shares = only["hit_share_by_tier"]
    assert shares["device"] > 0 and only["hit_share"] == pytest.approx(sum(shares.values()))
    assert only["hit_share"] <= 1
    # the replicas' hits are the cached tokens the responses reported
    assert sum(only["hit_tokens_by_tier"].values()) == s["cached_tokens"]
    assert [r["round"] for r in only["rounds"]] == [1, 2]
    assert sum(r["cached_tokens"] for r in only["rounds"]) == s["cached_tokens"]
    # where the time went, per replica, from their phase histograms: every request counted once
    phases = only["phases"]
    assert sum(ph["requests"] for ph in phases.values()) == 8
    # (the ring may put every session on one replica: one with none has no phase times)
    assert all(ph["decode"] > 0 for ph in phases.values() if ph["requests"])
    assert all(ph["queue"] >= 0 and ph["prefill"] > 0 for ph in phases.values() if ph["requests"])
    load = only["load"]
    assert len(load["mean_running"]) == 2 and 0 <= load["stranded_share"] <= 1


def test_kv_aware_keeps_a_conversation_on_the_replica_it_started_on(tmp_path: Path) -> None:
    """kv_aware places each conversation's first round by KV cost and load, and every later round
    goes to the replica its session is bound to (the router's own decision counters); with
    --kv-aware-session-ttl 0 every round is placed by cost alone."""
    for ttl, decisions in ((600, {"prefix_cost": 4, "sticky_hit": 4}), (0, {"prefix_cost": 8})):
        args = _args(tmp_path, "--policies", "kv_aware", "--num-prompts", "4")
        args.num_rounds, args.prefix_len, args.max_concurrency = 2, 64, 4
        args.kv_aware_session_ttl = ttl
        assert router.run(args) == 0
        (only,) = json.loads((tmp_path / "router.json").read_text())["policies"]
        assert only["summary"]["completed"] == 8
        assert only["router_decisions"] == decisions
        assert only["hit_share_by_tier"]["device"] > 0


def test_without_remote_no_redis_runs_and_nothing_is_found_remotely(tmp_path: Path) -> None:
    """--no-remote starts no redis-server (a missing binary is no error) and gives the replicas
    no --kv-remote-url, so nothing is found in the remote tier; a benchmark model named by its
    built-in name is written for the run and served under that name."""
    before = _children()
    args = _args(
        tmp_path, "--policies", "round_robin", "--num-prompts", "4", "--no-remote",
        "--redis-server", "no-such-redis", "--model", "tiny-llama",
    )  # fmt: skip
    args.num_rounds, args.prefix_len, args.input_len, args.max_concurrency = 2, 32, 16, 4
    args.num_prefixes = 1
    assert router.run(args) == 0
    assert _children() <= before
    res = json.loads((tmp_path / "router.json").read_text())
    (only,) = res["policies"]
    assert only["summary"]["completed"] == 8
    assert only["hit_tokens_by_tier"]["remote"] == 0
    # round_robin sent the first rounds to both replicas, so each has prefilled the one system
    # prompt and every second round finds it on the device, wherever it goes
    assert only["hit_share_by_tier"]["device"] > 0
    assert res["config"]["no_remote"] is True and res["config"]["model"] == "tiny-llama"


def test_replica_and_router_command_lines(tmp_path: Path) -> None:
    """The shared tier is on every replica's command line unless --no-remote; --router-arg is
    passed to every policy's router, and only kv_aware's subscribes to the replicas' events."""
    args = _args(tmp_path, "--router-arg=--balance-abs-threshold=4", "--serve-arg=--seed=1")
    remote = router.replica_command(args, "kvtier-default", 8001, "redis://127.0.0.1:6379/0")
    assert remote[remote.index("--kv-remote-url") + 1] == "redis://127.0.0.1:6379/0"
    assert remote[-1] == "--seed=1"
    args = _args(tmp_path, "--no-remote")
    local = router.replica_command(args, "/models/m", 8001, None)
    assert "--kv-remote-url" not in local and "/models/m" in local
    args = _args(tmp_path, "--router-arg=--balance-abs-threshold=4")
    workers = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    cache = router.router_command(args, "cache_aware", (9000, 9001), workers, [])
    assert cache[cache.index("--policy") + 1] == "cache_aware"
    assert cache[-1] == "--balance-abs-threshold=4" and "--kv-event-source" not in cache
    sources = [(w, 7000 + i, 7100 + i) for i, w in enumerate(workers)]
    kv = router.router_command(args, "kv_aware", (9000, 9001), workers, sources)
    assert kv.count("--kv-event-source") == 2 and kv[-1] == "--balance-abs-threshold=4"
    assert kv[kv.index("--kv-aware-session-affinity-ttl-secs") + 1] == "600"


def test_replicas_get_their_own_cpus_when_there_are_enough() -> None:
    """--replica-cpus split: disjoint equal shares (taskset on the command line; kvtier sizes its
    threads from the affinity it starts with); fewer CPUs than replicas: one CPU each, in turn,
    so no replica starts a thread per core on cores the others use."""
    assert router.replica_cpus(2, [3, 1, 0, 2]) == [[0, 1], [2, 3]]
    assert router.replica_cpus(2, [0, 1, 2]) == [[0], [1]]
    assert router.replica_cpus(4, [1, 0]) == [[0], [1], [0], [1]]
    assert router.replica_cpus(3, [5]) == [[5], [5], [5]]
    assert router.replica_cpus(2, []) is None


def test_a_pinned_replica_starts_under_taskset(tmp_path: Path) -> None:
    args = _args(tmp_path, "--no-remote")
    cmd = router.replica_command(args, "/models/m", 8001, None, [2, 3])
    assert cmd[:3] == ["taskset", "-c", "2,3"] and "serve" in cmd
    assert router.replica_command(args, "/models/m", 8001, None)[0] != "taskset"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--policies", "fastest"), "--policies: ['fastest'] not among"),
        (("--num-replicas", "1"), "--num-replicas must be at least 2"),
        (("--vllm-router", "no-such-router"), "pip install 'kvtier[router]'"),
        (("--num-prompts", "0"), "--num-prompts"),
        (("--kv-aware-session-ttl", "-1"), "--kv-aware-session-ttl must be 0"),
    ],
)
def test_bad_flags_name_the_flag(tmp_path: Path, flags: tuple[str, ...], needle: str) -> None:
    with pytest.raises(SystemExit, match=needle.replace("[", r"\[").replace("]", r"\]")):
        router.run(_args(tmp_path, *flags))


def test_a_replica_that_exits_is_the_error_with_its_log_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    """A replica that cannot start ends the run with its exit and its log's tail (where
    `kvtier serve` names the flag), and every process started before it is stopped."""
    before = _children()
    args = _args(tmp_path, "--policies", "round_robin", "--serve-arg=--no-such-flag")
    with pytest.raises(SystemExit, match=r"(?s)replica0 exited \(2\).*--no-such-flag"):
        router.run(args)
    assert _children() <= before


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        ps = ["ps", "-o", "pid=", "--ppid", str(todo.pop())]
        kids = {int(x) for x in subprocess.run(ps, capture_output=True, text=True).stdout.split()}
        out |= kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_terminated_bench_stops_every_process_it_started(tmp_path: Path) -> None:
    """`kvtier bench router` killed with SIGTERM mid-run (a timeout, a kill) stops its replicas
    and router, which run in sessions of their own, before it exits."""
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "router", "--model", "kvtier-default"]
    cmd += ["--policies", "round_robin", "--no-remote", "--num-prompts", "400"]
    cmd += ["--out", str(tmp_path / "router.json")]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert bench.stdout is not None
        for line in bench.stdout:  # the policy's header: every process is up
            if line.startswith("-- round_robin"):
                break
        started = _descendants(bench.pid)
        deadline = time.monotonic() + 120
        while len(started) < 5 and time.monotonic() < deadline:  # 2 × (HTTP + engine) + router
            time.sleep(0.5)
            started |= _descendants(bench.pid)
        assert len(started) >= 5, started
        bench.send_signal(signal.SIGTERM)
        rc = bench.wait(timeout=90)
    finally:
        bench.kill()
        bench.wait()
    left = [pid for pid in started if _alive(pid)]
    for pid in left:  # the orphans of a failed run must not outlive the test
        os.kill(pid, signal.SIGKILL)
    assert not left
    assert rc == 128 + signal.SIGTERM
