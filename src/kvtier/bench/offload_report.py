"""`kvtier bench offload`'s presentation: percentiles, on/off ratios, the printed rows, the chart."""

from __future__ import annotations

from typing import Any


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, median, p99 (linear interpolation, as numpy's default)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "median": pct(0.5), "p99": pct(0.99)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def print_row(row: dict[str, Any], total: int) -> None:
    td, tw, hf = row["ttft_device_ms"], row["ttft_wall_ms"], row["hit_fraction"]
    shares = " ".join(f"{tier} {share:.1%}" for tier, share in hf.items())
    print(
        f"{row['config']:9s} TTFT device ms mean {td['mean']:7.2f} median {td['median']:7.2f} "
        f"p99 {td['p99']:7.2f} | wall ms mean {tw['mean']:7.1f} median {tw['median']:7.1f} "
        f"p99 {tw['p99']:7.1f} | out tok/s device {row['tok_s_device'] or 0:8.0f} wall "
        f"{row['tok_s_wall']:6.0f} | prompt tokens: {shares} | host loads "
        f"{row['host_loads']['blocks']} blk ({row['host_loads']['bytes'] / 2**20:.1f} MiB) "
        f"stores {row['host_stores']['blocks']} blk ({row['host_stores']['bytes'] / 2**20:.1f} MiB)"
        f" | preempt {row['preemptions']} | hazards {row['hazards']} | same tokens as off "
        f"{row['same_tokens_as_off']}/{total}",
    )
    rounds = "  ".join(
        f"r{r['round']} {r['ttft_device_ms_mean']:.2f} ms ({r['device_hit']:.0%} device, "
        f"{r['host_hit']:.0%} loaded)"
        for r in row["by_round"]
    )
    print(f"{'':9s} by round, mean TTFT (device) and prompt hits: {rounds}", flush=True)
    for tier, io in row.get("lower_tiers", {}).items():
        print(
            f"{'':9s} {tier}: {io['promoted_blocks']} blocks promoted to host, "
            f"{io['demoted_blocks']} demoted, {io['dropped_blocks']} dropped, {io['errors']} errors, "
            f"{io['timeouts']} timeouts",
            flush=True,
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    x = range(len(rows))
    for i, stat in enumerate(("mean", "median", "p99")):
        a.bar(
            [j + (i - 1) * 0.27 for j in x],
            [r["ttft_device_ms"][stat] for r in rows],
            width=0.27,
            label=stat,
        )
    a.set_xticks(list(x), names)
    a.set_ylabel("TTFT, modelled device ms")
    a.legend()
    b.bar(names, [r["tok_s_device"] or 0 for r in rows], color="tab:green")
    b.set_ylabel("output tokens/s, modelled device time")
    bottom = [0.0] * len(rows)
    colors = {"device": "tab:blue", "host": "tab:orange", "disk": "tab:green"}
    colors |= {"remote": "tab:purple", "recompute": "tab:gray"}
    for tier, color in colors.items():
        vals = [100 * r["hit_fraction"].get(tier, 0.0) for r in rows]
        c.bar(names, vals, bottom=bottom, label=tier, color=color)
        bottom = [s + v for s, v in zip(bottom, vals, strict=True)]
    c.set_ylabel("prompt tokens (%)")
    c.legend()
    fig.suptitle("kvtier offload benchmark: host tier off vs on (sim device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
