"""`bench compare --co-tenant`: each kind starts a real process whose load is running before the
block is entered, is gone after it, and is recorded (kind, its CPU seconds) in the results."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from benchmarks import compare, cotenant
from benchmarks.peers import procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("kind", ["spin", "membw", "inference"])
def test_each_kind_runs_a_process_for_the_block_and_stops_it(kind: str, tmp_path: Path) -> None:
    with cotenant.running(kind, tmp_path / "co.log") as info:
        assert info["kind"] == kind
        pids = [p for p in procs.descendants(os.getpid()) if _alive(p)]
        assert pids, "no co-tenant process is running inside the block"
        if kind == "membw":
            assert info["copy_bytes"] == cotenant.COPY_BYTES
        if kind == "inference":
            assert info["model"] == "tiny-llama"
    assert info["cpu_s"] >= 0.0
    assert not [p for p in pids if _alive(p)], "the co-tenant outlived its block"


def test_none_starts_nothing(tmp_path: Path) -> None:
    before = set(procs.descendants(os.getpid()))
    with cotenant.running("none", tmp_path / "co.log") as info:
        assert set(procs.descendants(os.getpid())) == before
    assert info == {"kind": "none"}


def test_unknown_kind_names_the_flag_and_the_choices(tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match=r"--co-tenant 'disk'.*spin, membw, inference"),
        cotenant.running("disk", tmp_path / "co.log"),
    ):
        pass


def test_compare_takes_the_flag() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    assert parser.parse_args([]).co_tenant == "none"
    assert parser.parse_args(["--co-tenant", "membw"]).co_tenant == "membw"
    with pytest.raises(SystemExit):
        parser.parse_args(["--co-tenant", "disk"])
