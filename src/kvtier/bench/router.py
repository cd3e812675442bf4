"""`kvtier bench router`: one serving workload through vllm-router in front of N `kvtier serve`
replicas sharing one Redis (or, with --no-remote, each holding only its own tiers), once per routing
policy, each policy on fresh processes (a new redis-server, new replicas, a new router: every run
starts cold).

The workload is `kvtier bench serve`'s (default: shared-prefix, more conversations than one
replica's device and host tiers hold, starting as a Poisson stream), sent with an `X-Session-ID`
per conversation, the key vllm-router's session policies read. Per policy it reports the share of
prompt tokens found in each tier of the replicas (their `kvtier:prefix_cache_hits` over device
queries), TTFT median and p99, output tok/s and the requests each replica served; where a request's time went on each
replica (mean queue, prefill and decode seconds, from vLLM's phase histograms) and each replica's
running and waiting requests over time (sampled every 0.5 s); saves JSON and, with --plot, a PNG.
kv_aware runs with the replicas' KV events (`--kv-events-config`) as the router's event sources
and, by default, its session affinity on the same `X-Session-ID` (`--kv-aware-session-ttl`): its
cost is (uncached prompt tokens + the tokens still prefilling on a worker) × (the worker's requests
+ 1), so on prefill-bound replicas the load term outweighs a conversation's cached history and
later rounds leave the replica that holds it; with affinity a conversation's first round is placed
by that cost and its later rounds stay (docs/benchmarks.md, Routing).
Everything listens on 127.0.0.1 only; every process is stopped at the end of its policy's run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.bench import models, save_json
from kvtier.bench.procs import (
    Proc,
    ProcessFailed,
    free_port,
    healthy,
    http_get,
    listening,
    redis_command,
    spawn,
    stop,
    vllm_router_command,
    wait_for,
)
from kvtier.bench.router_report import TIERS, plot, render, render_where
from kvtier.bench.serve import add_workload_arguments, check_workload, sampling_extra

POLICIES = ("round_robin", "consistent_hash", "cache_aware", "kv_aware")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated vllm-router policies, run in this order (of {', '.join(POLICIES)})",
    )
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument(
        "--model",
        default=models.QWEN2_05B,  # prefill costs what routing saves (the embedded model's is ~free)
        help="`kvtier serve`'s model: kvtier-default, a folder, or a benchmark model written for "
        f"the run ({models.TINY_LLAMA}, {models.QWEN2_05B}: random weights, byte tokenizer)",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-device-blocks", type=int, default=512, help="per replica")
    parser.add_argument("--num-host-blocks", type=int, default=768, help="per replica")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more `kvtier serve` argument for every replica (repeat; e.g. --serve-arg=--async-scheduling)",
    )
    parser.add_argument(
        "--kv-aware-session-ttl",
        type=int,
        default=600,
        help="kv_aware: vllm-router's session affinity on X-Session-ID, idle TTL in seconds "
        "(--kv-aware-session-affinity-ttl-secs); 0: off, every round placed by KV cost and load",
    )
    parser.add_argument(
        "--no-remote",
        action="store_true",
        help="replicas without the shared Redis tier (no redis-server): each finds only what it "
        "holds itself, so locality is the policy's alone",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more vllm-router argument for every policy (repeat; e.g. "
        "--router-arg=--balance-abs-threshold=4)",
    )
    parser.add_argument(
        "--replica-cpus",
        choices=("split", "shared"),
        default="split",
        help="split: each replica pinned (taskset) to its own equal share of the usable CPUs, as "
        "replicas get their own devices (with fewer CPUs than replicas, one CPU each, in turn); "
        "shared: every replica on every CPU (default: %(default)s)",
    )
    parser.add_argument("--redis-server", default="redis-server", help="the binary to start")
    parser.add_argument("--vllm-router", default="vllm-router", help="the binary to start")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per process")
    add_workload_arguments(parser, dataset="shared-prefix")
    # A chat: each round's prompt is the conversation so far plus a short question, so a replica
    # that holds the history prefills only the question. In the byte tokenizer of the benchmark
    # models a word is ~4.5 tokens: a last round of ~860 tokens (54 blocks), and 32 conversations
    # (~1,370 blocks) more than one replica's device and host tiers hold, less than two's.
    parser.set_defaults(
        num_prompts=32,
        num_prefixes=4,
        prefix_len=48,
        num_rounds=6,
        input_len=24,
        output_len=16,  # the random model's answers decode to ~nothing: they add no history
        # Open loop: conversations start as a Poisson stream (a request rate is what a router is
        # judged at), each round sent when the last answer is in. A closed loop at a fixed
        # concurrency keeps the replicas saturated, where a request's latency is the concurrency
        # over the throughput whatever the policy (Little's law) and TTFT is only the schedulers'
        # split of it. 0.25 a second: two one-core replicas of the 0.5B shape keep up under every
        # policy at the default pool sizes (docs/benchmarks.md, Scale-out at an offered load).
        request_rate=0.25,
        max_concurrency=0,  # unlimited
        prompt_format="text",  # what a prefix-matching router reads
    )
    stamp = time.strftime("%Y-%m-%d")
    parser.add_argument("--out", default=f"results/bench_router_{stamp}.json")
    parser.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        help="write a PNG comparing the policies (default path: --out with .png)",
    )


def served_name(model: str) -> str:
    """The name every replica serves the model as (the router's model identity too)."""
    return "kvtier-default" if model == "kvtier-default" else Path(model).name


def _parse(text: str) -> list[Any]:
    """Every sample of a Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _samples(url: str, who: str) -> list[Any]:
    """Every sample of the Prometheus text at `url` (SystemExit naming `who` unless it answers)."""
    status, text = http_get(url)
    if status != 200:
        raise SystemExit(f"{who}: GET /metrics answered {status}")
    return _parse(text)


TIER_COUNTERS = {
    "kvtier:prefix_cache_hits_total": "hits",
    "kvtier:prefix_cache_queries_total": "queries",
}
# where a request's time goes on its replica (vLLM's phase histograms): seconds summed and counted
PHASES = {
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:request_decode_time_seconds": "decode",
}


def _tier_counters(p: Proc) -> dict[str, float]:
    """`tier:hits` and `tier:queries` token counts, and `served` (finished requests), from a
    replica's /metrics."""
    out: dict[str, float] = {}
    for s in _samples(f"{p.url}/metrics", p.name):
        if s.name in TIER_COUNTERS:
            out[f"{s.labels['tier']}:{TIER_COUNTERS[s.name]}"] = s.value
        elif s.name == "vllm:request_success_total":
            out["served"] = out.get("served", 0.0) + s.value
        elif s.name.endswith(("_sum", "_count")) and s.name.rsplit("_", 1)[0] in PHASES:
            base, kind = s.name.rsplit("_", 1)
            out[f"{PHASES[base]}:{kind}"] = s.value
    return out


def _phase_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A replica's mean seconds per request in each phase over the run (its histograms' deltas),
    and the requests its queue phase counted."""
    out = {}
    for phase in PHASES.values():
        n = after.get(f"{phase}:count", 0.0) - before.get(f"{phase}:count", 0.0)
        total = after.get(f"{phase}:sum", 0.0) - before.get(f"{phase}:sum", 0.0)
        out[phase] = total / n if n else 0.0
        if phase == "queue":
            out["requests"] = n
    return out


class LoadSampler:
    """Each replica's requests running and waiting (vLLM's gauges), sampled every `period`
    seconds on a thread while the workload runs: whether a policy balanced the load over time,
    not only over the run."""

    GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

    def __init__(self, replicas: list[Proc], period: float = 0.5) -> None:
        self.replicas, self.period = replicas, period
        self.samples: list[list[tuple[float, float]]] = [[] for _ in replicas]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for i, p in enumerate(self.replicas):
                status, text = http_get(f"{p.url}/metrics", timeout=5)
                if status != 200:
                    continue
                values = dict.fromkeys(self.GAUGES, 0.0)
                for sample in _parse(text):
                    if sample.name in values:
                        values[sample.name] += sample.value
                self.samples[i].append((values[self.GAUGES[0]], values[self.GAUGES[1]]))

    def summary(self) -> dict[str, Any]:
        """Per replica: mean running and waiting; over the samples all replicas answered: the
        mean spread (most minus fewest in flight) and the share of samples where one replica had
        requests waiting while another had none in flight."""
        n = min((len(s) for s in self.samples), default=0)
        in_flight = [[r + w for r, w in s[:n]] for s in self.samples]
        spread = [max(col) - min(col) for col in zip(*in_flight)]
        stranded = [
            any(s[k][1] > 0 for s in self.samples) and min(col) == 0
            for k, col in enumerate(zip(*in_flight))
        ]
        return {
            "samples": n,
            "period_s": self.period,
            "mean_running": [sum(r for r, _ in s) / len(s) if s else 0.0 for s in self.samples],
            "mean_waiting": [sum(w for _, w in s) / len(s) if s else 0.0 for s in self.samples],
            "mean_spread": sum(spread) / n if n else 0.0,
            "stranded_share": sum(stranded) / n if n else 0.0,
        }


def _decision_outcomes(metrics_port: int) -> dict[str, float]:
    """The router's prefix-aware decisions by outcome, from its /metrics (empty for the policies
    that count none)."""
    out: dict[str, float] = {}
    for s in _samples(f"http://127.0.0.1:{metrics_port}/metrics", "router"):
        if s.name == "vllm_router_prefix_routing_decisions_total":
            out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def replica_cpus(num_replicas: int, usable: list[int]) -> list[list[int]] | None:
    """Each replica's own CPUs, an equal share of `usable` (the rest unused). With fewer CPUs
    than replicas each replica gets one CPU, the replicas taking the CPUs in turn, so each runs
    one thread and replicas on one CPU take turns on it as processes. Unpinned, they would
    each start a thread per core for the same cores and their spinning kernel threads would take
    turns on them: the run would measure that oversubscription, not the routing. None only
    without any usable CPU."""
    if not usable:
        return None
    ordered = sorted(usable)
    share = len(ordered) // num_replicas
    if share == 0:
        return [[ordered[i % len(ordered)]] for i in range(num_replicas)]
    return [ordered[i * share : (i + 1) * share] for i in range(num_replicas)]


def replica_command(
    args: argparse.Namespace,
    model: str,
    port: int,
    remote_url: str | None,
    cpus: list[int] | None = None,
) -> list[str]:
    """One `kvtier serve` replica of `model` (a folder, or kvtier-default) on 127.0.0.1:`port`,
    on the shared tier at `remote_url` unless it is None (--no-remote), pinned to `cpus` if
    given (kvtier sizes its threads from its affinity)."""
    cmd = [] if cpus is None else ["taskset", "-c", ",".join(map(str, cpus))]
    cmd += [sys.executable, "-m", "kvtier.cli", "serve"]
    cmd += [] if model == "kvtier-default" else [model]
    cmd += ["--served-model-name", served_name(args.model)]
    cmd += ["--port", str(port), "--max-model-len", str(args.max_model_len)]
    cmd += ["--num-device-blocks", str(args.num_device_blocks)]
    cmd += ["--num-host-blocks", str(args.num_host_blocks)]
    cmd += [] if remote_url is None else ["--kv-remote-url", remote_url]
    return [*cmd, *args.serve_arg]


def events_config(pub: int, replay: int) -> list[str]:
    """A replica's KV events on the ZMQ ports the router subscribes to (kv_aware)."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    # as vLLM's publisher, a wildcard host binds (any other host connects); the router's
    # subscriber connects to 127.0.0.1
    events |= {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return ["--kv-events-config", json.dumps(events)]


def router_command(
    args: argparse.Namespace,
    policy: str,
    ports: tuple[int, int],
    workers: list[str],
    sources: list[tuple[str, int, int]],
) -> list[str]:
    """vllm-router with `policy` on `ports` (serving, metrics) in front of `workers`; for
    kv_aware, subscribed to each replica's (url, publisher port, replay port) in `sources`."""
    cmd = vllm_router_command(args.vllm_router, *ports, workers)
    cmd += ["--policy", policy, "--request-timeout-secs", str(int(args.timeout) + 60)]
    for url, pub, replay in sources:
        cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}"]
        cmd += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
    if sources:
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", served_name(args.model)]
        if args.kv_aware_session_ttl:
            cmd += ["--kv-aware-session-affinity-ttl-secs", str(args.kv_aware_session_ttl)]
    return [*cmd, *args.router_arg]


@contextmanager
def _deployment(args: argparse.Namespace, policy: str, folder: Path) -> Iterator[Any]:
    """Redis (unless --no-remote), the replicas and vllm-router with `policy`, all healthy;
    stopped on exit."""
    procs: list[Proc] = []
    try:
        remote_url = None
        if not args.no_remote:
            port = free_port()
            procs.append(
                spawn(redis_command(args.redis_server, port, folder), folder / "redis.log", port)
            )
            wait_for(procs, listening, args.startup_timeout)
            remote_url = f"redis://127.0.0.1:{port}/0"
        replicas, sources = [], []
        shares = None
        if args.replica_cpus == "split":
            shares = replica_cpus(args.num_replicas, list(os.sched_getaffinity(0)))
        for i in range(args.num_replicas):
            port = free_port()
            cpus = None if shares is None else shares[i]
            cmd = replica_command(args, args.model_folder, port, remote_url, cpus)
            if policy == "kv_aware":
                pub, replay = free_port(), free_port()
                cmd += events_config(pub, replay)
                sources.append((f"http://127.0.0.1:{port}", pub, replay))
            replicas.append(spawn(cmd, folder / f"replica{i}.log", port))
        procs += replicas
        wait_for(replicas, healthy, args.startup_timeout)
        port, metrics_port = free_port(), free_port()
        cmd = router_command(args, policy, (port, metrics_port), [p.url for p in replicas], sources)
        router = spawn(cmd, folder / "router.log", port)
        procs.append(router)
        wait_for([router], healthy, args.startup_timeout)
        yield replicas, router, metrics_port
    except ProcessFailed as exc:  # a process's own words, as the command's error
        raise SystemExit(str(exc)) from None
    finally:
        stop(reversed(procs), timeout=30)


def _run_policy(args: argparse.Namespace, policy: str, workload: Any) -> dict[str, Any]:
    from kvtier.bench import serve_client, serve_report

    convs, tok, settings, percentiles = workload
    folder = Path(tempfile.mkdtemp(prefix=f"kvtier-bench-router-{policy}-"))
    with _deployment(args, policy, folder) as (replicas, router, metrics_port):
        before = [_tier_counters(p) for p in replicas]
        with LoadSampler(replicas) as load:
            records, duration = asyncio.run(
                serve_client.run_all(convs, settings, tok, args.max_concurrency, router.url)
            )
        after = [_tier_counters(p) for p in replicas]
        decisions = _decision_outcomes(metrics_port)
    summary = serve_report.summarize(records, duration, percentiles)
    delta = {k: sum(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(after, before)) for k in after[0]}
    prompt_tokens = delta.get("device:queries", 0.0)
    hits = {t: delta.get(f"{t}:hits", 0.0) for t in TIERS}
    # the host tier counts every token loaded through it, the lower tiers' hits included
    hits["host"] -= hits["disk"] + hits["remote"]
    shares = {t: hits[t] / prompt_tokens if prompt_tokens else 0.0 for t in TIERS}
    shutil.rmtree(folder, ignore_errors=True)  # logs are kept only when a process failed
    return {
        "policy": policy,
        "hit_tokens_by_tier": hits,
        "hit_share_by_tier": shares,
        "hit_share": sum(shares.values()),
        "prompt_tokens_looked_up": prompt_tokens,
        # where the policy sent them (kv_aware counts no decisions per worker, so the replicas do)
        "served": {p.name: a["served"] - b["served"] for p, a, b in zip(replicas, after, before)},
        # kv_aware's decisions by outcome: "prefix_cost" (placed by KV cost and load),
        # "sticky_hit" (a session's bound replica)
        "router_decisions": decisions,
        "summary": summary,
        # TTFT and cached share by round: where a policy loses a conversation's history
        "rounds": serve_report.rounds(records),
        # per replica: mean seconds a request spent queued, prefilling and decoding there
        "phases": {p.name: _phase_means(b, a) for p, b, a in zip(replicas, before, after)},
        "load": load.summary(),
    }


def run(args: argparse.Namespace) -> int:
    try:
        from kvtier.bench import serve_client  # noqa: F401  (httpx is a dev extra)
    except ImportError as exc:
        raise SystemExit(f"kvtier bench router needs {exc.name}: pip install -e '.[dev]'") from None

    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"--policies: {unknown or 'none'} not among {', '.join(POLICIES)}")
    if args.num_replicas < 2:
        raise SystemExit("--num-replicas must be at least 2 (one replica needs no router)")
    if not 0 <= args.kv_aware_session_ttl <= 31_536_000:  # the router's range
        raise SystemExit("--kv-aware-session-ttl must be 0 (off) to 31536000 seconds")
    binaries = [(args.vllm_router, "--vllm-router", "pip install 'kvtier[router]'")]
    if not args.no_remote:
        binaries.append((args.redis_server, "--redis-server", "apt-get install redis-server"))
    if args.replica_cpus == "split":
        binaries.append(("taskset", "--replica-cpus split", "apt-get install util-linux, or "
                         "--replica-cpus shared"))  # fmt: skip
    for binary, flag, hint in binaries:
        if shutil.which(binary) is None:
            raise SystemExit(f"{flag} {binary!r} is not on PATH: {hint}")
    check_workload(args)
    written = Path(tempfile.mkdtemp(prefix="kvtier-bench-router-model-"))
    try:  # a benchmark model is written once and served by every replica of every policy
        builtin = args.model in (models.TINY_LLAMA, models.QWEN2_05B)
        args.model_folder = str(models.model_path(args.model, written)) if builtin else args.model
        return _run_policies(args, policies)
    finally:
        shutil.rmtree(written, ignore_errors=True)


def _run_policies(args: argparse.Namespace, policies: list[str]) -> int:
    from kvtier.bench import serve_client, serve_data

    extra = sampling_extra(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    tok = serve_data.resolve_tokenizer(args.tokenizer, args.model_folder)
    use_ids = args.prompt_format == "ids" or (args.prompt_format == "auto" and tok is not None)
    if use_ids and tok is None:
        raise SystemExit("--prompt-format ids needs a tokenizer (--tokenizer)")
    convs = serve_data.build(serve_data.Dataset.from_args(args), tok, use_ids)
    settings = serve_client.Settings(
        url="/v1/completions",
        model=served_name(args.model),
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout=args.timeout,
        extra=extra,
        session_header="X-Session-ID",
    )
    print(
        f"bench router: {args.dataset}, {args.num_prompts} conversations × "
        f"{len(convs[0].questions)} rounds, concurrency {args.max_concurrency or 'unlimited'}, "
        f"{args.num_replicas} replicas of {args.model} × ({args.num_device_blocks} device + "
        f"{args.num_host_blocks} host blocks) "
        f"{'each on its own' if args.no_remote else 'on one Redis'}; policies {', '.join(policies)}",
        flush=True,
    )
    results = []
    for policy in policies:
        print(f"-- {policy}", flush=True)
        results.append(_run_policy(args, policy, (convs, tok, settings, percentiles)))
        print(render([results[-1]], percentiles), flush=True)
        print(render_where(results[-1]), flush=True)
    print(render(results, percentiles))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "model_folder")}
    config["request_rate"] = str(args.request_rate)
    print(f"saved {save_json({'config': config, 'policies': results}, args.out)}")
    if args.plot is not None:
        png = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
        print(f"plot {plot(results, png, percentiles, args.no_remote)}")
    return 0 if all(r["summary"]["completed"] for r in results) else 1
