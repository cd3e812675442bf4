"""`kvtier bench router`'s report: the policies side by side as a table, where each policy's
request time went on the replicas, and a PNG (hits by tier, TTFT, output tok/s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIERS = ("device", "host", "disk", "remote")


def render(results: list[dict[str, Any]], percentiles: list[float]) -> str:
    p = f"p{percentiles[-1]:g}" if percentiles else None
    head = f"{'policy':<16}{'hits':>7}" + "".join(f"{t:>8}" for t in TIERS)
    head += (
        f"{'TTFT p50':>10}"
        + (f"{'TTFT ' + p:>11}" if p else "")
        + f"{'out tok/s':>11}{'failed':>8}"
    )
    lines = [head]
    for r in results:
        s = r["summary"]
        row = f"{r['policy']:<16}{r['hit_share']:>7.1%}"
        row += "".join(f"{r['hit_share_by_tier'][t]:>8.1%}" for t in TIERS)
        row += f"{s['median_ttft_ms']:>8.0f}ms"
        row += f"{s[f'{p}_ttft_ms']:>9.0f}ms" if p else ""
        row += f"{s['output_throughput']:>11.1f}{s['failed']:>8}"
        lines.append(row)
    return "\n".join(lines)


def render_where(r: dict[str, Any]) -> str:
    """Where a policy's request time went: each replica's mean queue / prefill / decode seconds,
    and how its load spread over time."""
    parts = [
        f"{name} queue {ph['queue']:.2f}s prefill {ph['prefill']:.2f}s decode {ph['decode']:.2f}s"
        for name, ph in r["phases"].items()
    ]
    load = r["load"]
    running = "/".join(f"{x:.1f}" for x in load["mean_running"])
    waiting = "/".join(f"{x:.1f}" for x in load["mean_waiting"])
    parts.append(
        f"running {running} waiting {waiting}, spread {load['mean_spread']:.1f}, "
        f"one waiting while one idle {load['stranded_share']:.0%} ({load['samples']} samples)"
    )
    return "  " + "\n  ".join(parts)


def plot(
    results: list[dict[str, Any]], path: Path, percentiles: list[float], no_remote: bool = False
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    bottom = [0.0] * len(results)
    for tier in TIERS:
        vals = [100 * r["hit_share_by_tier"][tier] for r in results]
        axes[0].bar(names, vals, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_ylabel("prompt tokens found (%)")
    axes[0].set_title("prefix hits by tier")
    axes[0].legend(loc="lower right", fontsize="small")
    p = f"p{percentiles[-1]:g}" if percentiles else None
    x = range(len(results))
    axes[1].bar(
        [i - 0.2 for i in x], [r["summary"]["median_ttft_ms"] for r in results], 0.4, label="median"
    )
    if p:
        axes[1].bar(
            [i + 0.2 for i in x], [r["summary"][f"{p}_ttft_ms"] for r in results], 0.4, label=p
        )
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_title("time to first token")
    axes[1].legend(loc="lower right", fontsize="small")
    axes[2].bar(names, [r["summary"]["output_throughput"] for r in results])
    axes[2].set_ylabel("output tok/s")
    axes[2].set_title("output throughput")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    shared = "replicas without a shared tier" if no_remote else "replicas sharing one Redis"
    fig.suptitle(f"kvtier bench router: one workload through vllm-router, by policy ({shared})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
