"""`kvtier bench router` for real: it starts a redis-server, two `kvtier serve` replicas and
vllm-router, runs the workload through the router, reads the tiers' hits from the replicas and the
requests each one served, and stops every process it started."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvtier.bench import router


def _args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router.add_arguments(parser)
    return parser.parse_args(["--out", str(tmp_path / "router.json"), *flags])


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
