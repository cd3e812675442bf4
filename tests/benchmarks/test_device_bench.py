"""`kvtier bench device` runs end to end on a few steps: JSON shape and a race-free workload."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import device as bench
from kvtier.device import KVLayout, RaceError


def args_for(tmp_path: Path, **kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--steps", "5", "--repeats", "1", "--out", str(tmp_path / "b.json")])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_bench_saves_every_configuration_and_the_overhead(tmp_path: Path) -> None:
    assert bench.run(args_for(tmp_path)) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    configs = [(r["backend"], r["sanitizer"]) for r in data["runs"]]
    assert configs == [("sim", "off"), ("sim", "collect"), ("cpu", "off"), ("cpu", "collect")]
    assert all(r["ops"] == data["runs"][0]["ops"] > 0 and r["hazards"] == 0 for r in data["runs"])
    assert set(data["overhead"]) == {
        "sanitizer_us_per_step",
        "sanitizer_pct_of_tiny_step",
        "sim_device_layer_pct_of_tiny_step",
        "cpu_device_layer_pct_of_tiny_step",
    }
    assert data["overhead"]["sanitizer_us_per_step"] > 0 and data["tiny_step_us"] > 0
    assert "meta" in data


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_bench_workload_is_ordered_under_a_raising_sanitizer(backend: str) -> None:
    shape = bench.StepShape()
    layout = KVLayout(2, 16, 4, 16)
    dev = bench.make_bench_device(backend, "raise", 0, layout, shape)  # type: ignore[arg-type]
    bench.run_steps(dev, shape, 40)  # > blocks_per_req: every ring wraps at least twice
    assert dev.num_ops == 40 * 6 + 39  # 2 loads, forward, 2 stores, sampled copy; host update


def test_bench_without_the_compute_done_event_would_race() -> None:
    shape = bench.StepShape()
    dev = bench.make_bench_device("cpu", "raise", 0, KVLayout(2, 16, 4, 16), shape)
    dev.wait = lambda stream, event: None  # type: ignore[method-assign]  # drop every wait
    with pytest.raises(RaceError):
        bench.run_steps(dev, shape, 3)


def test_bench_rejects_too_few_steps(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--steps"):
        bench.run(args_for(tmp_path, steps=1))
