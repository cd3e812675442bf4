"""Summary of `kvtier bench serve` in `vllm bench serve`'s terms (its JSON key names too), the
per-round table of multi-round runs, and the optional PNG of TTFT / ITL distributions."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.serve_client import Record

METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


# A gap between chunks shorter than this is chunks that reached the client together: it is far
# below the time of a decode step of any model here.
FLUSHED_GAP_S = 1e-4


def flushed(r: Record) -> bool:
    """Whether a stream's tokens mostly reached the client at once (most gaps under FLUSHED_GAP_S):
    a server that held them back, or a client that got no CPU while they queued (on two cores
    shared with the engines). Its TPOT then times no decode step, and its TTFT is the wait for
    (nearly) the whole answer."""
    return len(r.itl) > 1 and 2 * sum(g < FLUSHED_GAP_S for g in r.itl) > len(r.itl)


def _tpot(r: Record) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1)  # as vLLM: decode time after the 1st


def _values(ok: list[Record]) -> dict[str, list[float]]:
    tpot = [_tpot(r) for r in ok if r.output_tokens > 1]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": tpot,
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }


def _peaks(ok: list[Record]) -> tuple[float, int]:
    """Most output chunks in any 1-second bucket, and most requests in flight at once."""
    buckets: Counter[int] = Counter()
    events: list[tuple[float, int]] = []
    for r in ok:
        t = r.start + r.ttft
        buckets[int(t)] += 1
        for gap in r.itl:
            t += gap
            buckets[int(t)] += 1
        events += [(r.start, 1), (r.start + r.latency, -1)]
    now = peak = 0
    for _, d in sorted(events):
        now += d
        peak = max(peak, now)
    return float(max(buckets.values(), default=0)), peak


def summarize(records: list[Record], duration: float, percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    inp = sum(r.input_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = [r for r in ok if r.cached_tokens is not None]
    s: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out / duration if duration > 0 else 0.0,
        "total_token_throughput": (inp + out) / duration if duration > 0 else 0.0,
        "count_sources": dict(Counter(r.count_source for r in ok)),
        "cached_tokens": sum(r.cached_tokens or 0 for r in cached),
        "prefix_cache_hit_rate": (
            sum(r.cached_tokens or 0 for r in cached) / max(1, sum(r.input_tokens for r in cached))
            if cached
            else None
        ),
    }
    s["max_output_tokens_per_s"], s["max_concurrent_requests"] = _peaks(ok)
    apart = [r for r in ok if not flushed(r)]
    s["flushed_requests"] = len(ok) - len(apart)
    streamed = [_tpot(r) for r in apart if r.output_tokens > 1]
    s["median_tpot_streamed_ms"] = 1000.0 * float(np.median(streamed)) if streamed else math.nan
    for key, vals in _values(ok).items():
        ms = np.asarray(vals, dtype=float) * 1000.0
        empty = ms.size == 0
        s[f"mean_{key}_ms"] = float(ms.mean()) if not empty else math.nan
        s[f"median_{key}_ms"] = float(np.median(ms)) if not empty else math.nan
        s[f"std_{key}_ms"] = float(ms.std()) if not empty else math.nan
        for p in percentiles:
            s[f"p{p:g}_{key}_ms"] = float(np.percentile(ms, p)) if not empty else math.nan
    s["errors"] = dict(Counter(r.error.split(":")[0] for r in records if not r.success))
    return s


def rounds(records: list[Record]) -> list[dict[str, Any]]:
    """Per round of the conversations: requests, failures, mean TTFT, cached share of input."""
    out = []
    for r in sorted({rec.round for rec in records}):
        recs = [x for x in records if x.round == r]
        ok = [x for x in recs if x.success]
        inp = sum(x.input_tokens for x in ok)
        cached = sum(x.cached_tokens or 0 for x in ok)
        out.append(
            {
                "round": r + 1,
                "completed": len(ok),
                "failed": len(recs) - len(ok),
                "input_tokens": inp,
                "cached_tokens": cached,
                "cached_share": cached / inp if inp else 0.0,
                "mean_ttft_ms": 1000 * float(np.mean([x.ttft for x in ok])) if ok else math.nan,
            }
        )
    return out


def render(s: dict[str, Any], by_round: list[dict[str, Any]], concurrency: int | None) -> str:
    w = 40

    def row(name: str, value: Any, fmt: str = "") -> str:
        return f"{name:<{w}}{value:{fmt}}"

    hit = s["prefix_cache_hit_rate"]
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", s["completed"]),
        row("Failed requests:", s["failed"]),
        row("Maximum request concurrency:", concurrency if concurrency else "unlimited"),
        row("Benchmark duration (s):", s["duration"], ".2f"),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput"], ".2f"),
        row("Output token throughput (tok/s):", s["output_throughput"], ".2f"),
        row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"], ".2f"),
        row("Peak concurrent requests:", s["max_concurrent_requests"]),
        row("Total token throughput (tok/s):", s["total_token_throughput"], ".2f"),
        row("Prefix cache hit rate (%):", "n/a" if hit is None else f"{100 * hit:.2f}"),
        row("Streams flushed at once:", s["flushed_requests"]),
        row("Median TPOT of the others (ms):", s["median_tpot_streamed_ms"], ".2f"),
    ]
    pct = sorted(k for k in s if k.startswith("p") and k.endswith("_ttft_ms"))
    for key, title, short in METRICS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", s[f"mean_{key}_ms"], ".2f"))
        lines.append(row(f"Median {short} (ms):", s[f"median_{key}_ms"], ".2f"))
        for p in pct:
            label = p[1:].split("_")[0]
            lines.append(row(f"P{label} {short} (ms):", s[f"p{label}_{key}_ms"], ".2f"))
    if len(by_round) > 1:
        lines.append("{s:{c}^{n}}".format(s="Rounds", n=50, c="-"))
        lines.append(
            f"{'round':>5} {'ok':>5} {'failed':>6} {'input':>8} {'cached %':>9} {'TTFT ms':>9}"
        )
        for r in by_round:
            lines.append(
                f"{r['round']:>5} {r['completed']:>5} {r['failed']:>6} {r['input_tokens']:>8} "
                f"{100 * r['cached_share']:>9.1f} {r['mean_ttft_ms']:>9.2f}"
            )
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot(records: list[Record], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    vals = _values(ok)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
        ms = np.asarray(vals[key], dtype=float) * 1000.0
        if ms.size:
            ax.hist(ms, bins=min(50, max(5, ms.size // 4)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                v = float(np.percentile(ms, q))
                ax.axvline(v, color="k", linestyle=style, label=f"p{q} {v:.1f} ms")
            ax.legend()
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{label} distribution ({ms.size} samples)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
