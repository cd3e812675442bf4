"""`kvtier bench admission` end to end at toy size, and the max concurrency that startup sizing,
`kvtier plan` and /metrics report against what admission really admits on the sim device."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.bench import admission
from kvtier.cli import main
from kvtier.config import ADMISSION_POLICIES

TOY = [
    "--max-model-len", "128", "--num-requests", "6,12", "--output-len", "8",
    "--pool-requests", "3", "--concurrency", "12", "--hidden-size", "32",
]  # fmt: skip


def test_admission_bench_at_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    rc = main(["bench", "admission", *TOY, "--out", str(out), "--plot", str(tmp_path / "a.png")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [w["fraction"] for w in result["workloads"]] == [0.97, 0.25]
    for w, num in zip(result["workloads"], (6, 12), strict=True):
        rows = {(r["admission"], r["protect"]): r for r in w["rows"]}
        assert sorted(rows) == sorted(
            [(p, "event,settled,quarantine") for p in ADMISSION_POLICIES] + [("optimistic", "none")]
        )
        for (name, protect), row in rows.items():
            assert row["requests"] == num and row["output_tokens"] == num * 8
            assert row["peak_running"] <= row["max_concurrency_at_prompt_len"], name
            if protect != "none":  # the protections hold whatever admission charges
                assert (row["garbled"], row["hazards"], row["preemptions"]) == (0, 0, 0), name
        # blocks NaN-poisoned when handed out: without the protections the race is reported
        assert rows[("optimistic", "none")]["hazards"] > 0
        assert set(w["vs_optimistic"]) == {
            "shared",
            "per-request",
            "optimistic",
            "optimistic (protect=none)",
        }
    near_max = {r["admission"]: r for r in result["workloads"][0]["rows"] if r["protect"] != "none"}
    conc = {name: r["max_concurrency_at_max_len"] for name, r in near_max.items()}
    assert conc["per-request"] < conc["optimistic"] <= conc["shared"], conc
    for r in near_max.values():  # near max length admission reaches the formula's concurrency
        assert r["peak_running"] == r["max_concurrency_at_prompt_len"]
    assert (tmp_path / "a.png").stat().st_size > 0


def test_unknown_policy_or_mismatched_lists_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.json"
    assert main(["bench", "admission", "--policies", "shared,fair", "--out", str(out)]) == 2
    assert "'fair'" in capsys.readouterr().err
    assert main(["bench", "admission", "--num-requests", "8", "--out", str(out)]) == 2
    assert "--num-requests" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    args = argparse.Namespace(seed=0, hidden_size=32, window=16, max_model_len=256)
    return admission.build_model(args, tmp_path_factory.mktemp("admission") / "gemma3-like")


@pytest.mark.parametrize("name", ADMISSION_POLICIES)
def test_reported_max_concurrency_is_what_admission_admits_at_max_length(
    name: str, toy_model: Path, tmp_path: Path
) -> None:
    """The startup log, `kvtier plan` and the /metrics gauge give one number N for a pool sized
    for 3 max-length requests under `name`'s charge; N + 2 max-length requests (255-token
    prompts, one output token, prefilled 16 tokens a step side by side) arrive at once on the
    sim device: exactly N run at once, none is preempted, every one finishes."""
    from kvtier.engine import LLM, SamplingParams
    from kvtier.server.engine_loop import layout_summary
    from kvtier.server.metrics import EngineMetrics

    plan_json = tmp_path / "plan.json"
    flags = ["--max-model-len", "256", "--max-num-batched-tokens", "96", "--admission", name]
    probe = ["plan", "--model", str(toy_model), *flags, "--num-device-blocks", "100000"]
    assert main([*probe, "--json", str(plan_json)]) == 0
    per_request = json.loads(plan_json.read_text())["blocks_per_max_len_request"]
    assert main([*probe[:-1], str(3 * per_request), "--json", str(plan_json)]) == 0
    n = json.loads(plan_json.read_text())["tiers"][0]["max_concurrency_at_max_len"]
    assert n >= 1
    llm = LLM(
        str(toy_model),
        device="sim",
        sanitize=True,
        poison=True,
        max_model_len=256,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=16,
        num_device_blocks=3 * per_request,
        admission=name,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    assert f"max concurrency at max length {n} (admission {name})" in layout_summary(engine)
    metrics = EngineMetrics(engine.plan.max_model_len)
    metrics.set_layout(engine)
    assert metrics.registry.get_sample_value("kvtier:max_concurrency", {"tier": "device"}) == n
    samples: list[tuple[int, int]] = []
    sample = admission.sample_running(engine, samples)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(n + 2):
        engine.add_request(f"r{i}", [3 + (7 * i + t) % 250 for t in range(255)], params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.req_id: o.result for o in engine.step() if o.result is not None}
        sample()
    assert len(done) == n + 2 and all(len(r.token_ids) == 1 for r in done.values())
    assert max(running for _, running in samples) == n
    assert engine.stats().num_preemptions == 0
