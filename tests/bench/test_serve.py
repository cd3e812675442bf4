"""`kvtier bench serve` against a real `kvtier serve` on 127.0.0.1: summary consistent with the
usage the server reported, multi-round prefix hits, failures counted (never raised), timeouts."""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import serve, serve_data
from kvtier.bench.serve_client import Record, count
from tests.server.conftest import MODEL, ServerHandle, start_server, stop_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = start_server(max_num_seqs=4, num_device_blocks=256, max_model_len=512)
    yield handle
    stop_server(handle)


def bench(srv: ServerHandle, tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(
        ["--base-url", srv.base_url, "--model", MODEL, "--out", str(out), *flags]
    )
    rc = serve.run(args)
    return rc, json.loads(out.read_text())


def check_consistent(res: dict[str, Any]) -> None:
    s, reqs = res["summary"], res["requests"]
    ok = [r for r in reqs if r["success"]]
    assert s["completed"] == len(ok) and s["failed"] == len(reqs) - len(ok)
    assert all(r["count_source"] == "usage" for r in ok)
    assert s["total_input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in ok)
    assert s["total_output_tokens"] == sum(r["usage"]["completion_tokens"] for r in ok)
    assert s["cached_tokens"] == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok
    )
    for r in ok:
        assert 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) == r["chunks"] - 1
        assert r["prompt_len"] == r["usage"]["prompt_tokens"]  # the ids we sent, as counted
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert s[key] > 0
    assert s["total_token_throughput"] > s["output_throughput"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"mean_{m}_ms"] > 0 and s[f"median_{m}_ms"] <= s[f"p99_{m}_ms"]
    assert s["mean_ttft_ms"] <= s["mean_e2el_ms"] and s["p99_ttft_ms"] <= s["p99_e2el_ms"]
    assert s["duration"] > 0 and s["max_concurrent_requests"] <= res["config"]["max_concurrency"]


def test_random_fixed_lengths(server: ServerHandle, tmp_path: Path, capsys: Any) -> None:
    rc, res = bench(
        server, tmp_path, "--num-prompts", "6", "--input-len", "32", "--output-len", "8",
        "--range-ratio", "0.5", "--max-concurrency", "2", "--ignore-eos", "--plot",
    )  # fmt: skip
    assert rc == 0
    check_consistent(res)
    s = res["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    for r in res["requests"]:
        assert r["usage"]["completion_tokens"] == r["max_tokens"]  # ignore_eos: fixed lengths
        assert 16 <= r["prompt_len"] <= 48
    assert (tmp_path / "serve.png").stat().st_size > 0
    text = capsys.readouterr().out
    for label in ("Successful requests:", "Median TPOT (ms):", "P99 E2EL (ms):", "Prefix cache"):
        assert label in text


def test_shared_prefix_rounds_hit_cache(server: ServerHandle, tmp_path: Path) -> None:
    rc, res = bench(
        server, tmp_path, "--dataset", "shared-prefix", "--num-prompts", "4",
        "--num-prefixes", "2", "--prefix-len", "48", "--num-rounds", "3", "--input-len", "16",
        "--output-len", "8", "--max-concurrency", "2", "--ignore-eos",
    )  # fmt: skip
    assert rc == 0
    check_consistent(res)
    rounds = res["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["completed"] == 4 for r in rounds)
    assert all(r["cached_tokens"] > 0 for r in rounds[1:])
    # each round's prompt extends the previous one: prompt + answer + question
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for r in res["requests"]:
        by_conv.setdefault(r["conversation"], []).append(r)
    for recs in by_conv.values():
        lens = [r["prompt_len"] for r in sorted(recs, key=lambda r: r["round"])]
        assert lens[0] == 48 + 16 and lens[0] < lens[1] < lens[2]
    assert 0 < res["summary"]["prefix_cache_hit_rate"] < 1


def test_server_errors_counted_as_failed(server: ServerHandle, tmp_path: Path) -> None:
    # prompts of 15..105 tokens + 8 output on a 64-token budget: some requests get a 400
    srv = start_server(max_num_seqs=2, num_device_blocks=64, max_model_len=64)
    try:
        rc, res = bench(
            srv, tmp_path, "--num-prompts", "8", "--input-len", "60", "--output-len", "8",
            "--range-ratio", "0.75", "--max-concurrency", "2", "--seed", "1",
        )  # fmt: skip
    finally:
        stop_server(srv)
    assert rc == 0
    s = res["summary"]
    assert s["completed"] > 0 and s["failed"] > 0 and s["completed"] + s["failed"] == 8
    check_consistent(res)
    failed = [r for r in res["requests"] if not r["success"]]
    assert all(r["error"].startswith("HTTP 400") for r in failed)
    assert all(r["prompt_len"] + 8 > 64 for r in failed)


def test_max_concurrency_zero_is_unlimited(server: ServerHandle, tmp_path: Path) -> None:
    """0 is "unlimited", as the run's banner says (`bench router`'s default, the one way to say
    it on its command line): every request is sent at once and served, none refused by a pool
    of 0 connections."""
    rc, res = bench(
        server, tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
        "--max-concurrency", "0", "--ignore-eos", "--timeout", "60",
    )  # fmt: skip
    assert rc == 0 and res["summary"]["completed"] == 3, res["summary"].get("errors")


def test_negative_max_concurrency_names_the_flag() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--model", "m"])
    args.max_concurrency = -1
    with pytest.raises(SystemExit, match="--max-concurrency"):
        serve.check_workload(args)


def test_wrong_model_and_timeouts_fail_without_raising(
    server: ServerHandle, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out = tmp_path / "x.json"
    base = ["--base-url", server.base_url, "--num-prompts", "3", "--out", str(out)]
    args = parser.parse_args([*base, "--model", "nope", "--tokenizer", "none"])
    assert serve.run(args) == 1
    res = json.loads(out.read_text())
    assert res["summary"]["failed"] == 3 and res["config"]["prompt_format"] == "text"
    assert all(r["error"].startswith("HTTP 404") for r in res["requests"])
    # A server that takes connections and never answers: every request times out, however
    # fast or loaded the machine (a real server could answer inside any short timeout).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the connections; nothing reads them
        mute = [f"--base-url=http://127.0.0.1:{silent.getsockname()[1]}", "--num-prompts", "3"]
        args = parser.parse_args([*mute, "--out", str(out), "--model", MODEL, "--timeout", "0.5"])
        assert serve.run(args) == 1
    res = json.loads(out.read_text())
    assert res["summary"]["failed"] == 3
    assert all(r["error"] == "timeout after 0.5 s" for r in res["requests"])
    closed = ["--base-url", "http://127.0.0.1:9", "--model", MODEL, "--timeout", "5"]
    args = parser.parse_args([*closed, "--num-prompts", "2", "--out", str(out)])
    assert serve.run(args) == 1
    assert json.loads(out.read_text())["summary"]["errors"] == {"ConnectError": 2}


def test_text_prompts_multi_round(server: ServerHandle, tmp_path: Path) -> None:
    rc, res = bench(
        server, tmp_path, "--tokenizer", "none", "--dataset", "shared-prefix",
        "--num-prompts", "2", "--num-prefixes", "1", "--prefix-len", "48", "--num-rounds", "2",
        "--input-len", "8", "--output-len", "4", "--max-concurrency", "2", "--ignore-eos",
    )  # fmt: skip
    assert rc == 0 and res["config"]["prompt_format"] == "text"
    s, reqs = res["summary"], res["requests"]
    assert s["completed"] == 4 and all(r["prompt_len"] is None for r in reqs)
    assert s["total_input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in reqs)
    assert res["rounds"][1]["cached_tokens"] > 0


def test_poisson_starts_and_fallback_counts() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "x", "--model", "m", "--num-prompts", "400"])
    args.request_rate = 50.0
    convs = serve_data.build(serve_data.Dataset.from_args(args), None, use_ids=False)
    starts = [c.start_delay for c in convs]
    assert starts[0] == 0 and starts == sorted(starts)
    assert 6 < starts[-1] < 10  # 399 gaps of mean 1/50 s
    tok = serve_data.resolve_tokenizer(None, MODEL)
    assert tok is not None
    rec = Record(0, 0, 4, 10, success=True, text=" the water", chunks=2)
    count(rec, tok)  # no usage reported: the tokenizer counts the output
    assert (rec.input_tokens, rec.output_tokens, rec.count_source) == (
        10,
        tok.count(" the water"),
        "tokenizer",
    )
    rec = Record(0, 0, 4, None, success=True, text="ab", chunks=3)
    count(rec, None)
    assert (rec.input_tokens, rec.output_tokens, rec.count_source) == (0, 3, "chunks")


def test_streams_flushed_at_once_are_counted() -> None:
    """A server that holds a request's tokens back and sends them together (vLLM's CPU server at
    concurrency 1 on two cores, now and then) reports TPOT ~0 and TTFT ~E2EL for it: the summary
    counts such streams, and only those whose gaps are mostly flushes."""
    from kvtier.bench import serve_report

    def rec(itl: list[float]) -> Record:
        ttft = 0.3 if not any(itl) else 0.02
        return Record(0, 0, 8, 4, True, ttft=ttft, latency=ttft + sum(itl), itl=itl,
                      output_tokens=len(itl) + 1)  # fmt: skip

    streamed = rec([0.004] * 7)
    flushed = rec([0.0] * 7)
    held_once = rec([0.004, 0.004, 0.0, 0.0, 0.004, 0.004, 0.004])  # two steps sent together
    assert [serve_report.flushed(r) for r in (streamed, flushed, held_once)] == [False, True, False]
    s = serve_report.summarize([streamed, flushed, held_once, rec([0.0] * 5)], 1.0, [99])
    assert s["flushed_requests"] == 2 and s["completed"] == 4
    assert s["median_tpot_ms"] == pytest.approx(20 / 7 / 2)  # as vLLM: every stream, flushed ~0
    assert s["median_tpot_streamed_ms"] == pytest.approx(4.0 * 0.5 + 20 / 7 * 0.5)
    assert "Streams flushed at once:" in serve_report.render(s, [], 1)


def test_sampling_flags_reach_the_server(server: ServerHandle, tmp_path: Path) -> None:
    """--top-k 1 makes a hot temperature draw the greedy tokens: the same completions as a greedy
    run only if the field reached the server; --top-p and --min-p ride along, all in the config."""
    common = ("--num-prompts", "4", "--input-len", "16", "--output-len", "12", "--ignore-eos",
              "--seed", "3", "--save-text")  # fmt: skip
    rc, greedy = bench(server, tmp_path, *common)
    assert rc == 0
    rc, top1 = bench(server, tmp_path, *common, "--temperature", "1.5", "--top-k", "1",
                     "--top-p", "0.9", "--min-p", "0.01")  # fmt: skip
    assert rc == 0 and top1["summary"]["failed"] == 0
    assert [r["text"] for r in top1["requests"]] == [r["text"] for r in greedy["requests"]]
    cfg = top1["config"]
    assert (cfg["temperature"], cfg["top_k"], cfg["top_p"], cfg["min_p"]) == (1.5, 1, 0.9, 0.01)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(("--top-p", "0"), "--top-p"), (("--top-p", "1.5"), "--top-p"), (("--top-k", "0"), "--top-k"),
     (("--min-p", "-0.1"), "--min-p"), (("--temperature", "-1"), "--temperature")],
)  # fmt: skip
def test_bad_sampling_flags_name_the_flag(flags: tuple[str, ...], needle: str) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--model", "m", *flags])
    with pytest.raises(SystemExit, match=needle):
        serve.sampling_extra(args)
