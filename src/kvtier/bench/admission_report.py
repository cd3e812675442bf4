"""`kvtier bench admission`'s presentation: the printed table, the ratios against `optimistic`
(vLLM before its fix, the seed's baseline) and the chart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def row_name(row: dict[str, Any]) -> str:
    return str(row["admission"]) + (" (protect=none)" if row["protect"] == "none" else "")


def compare(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each row against protected `optimistic`: throughput, duration and mean TTFT as relative
    changes, the shape in which the seed reports them."""
    base = next(
        (r for r in rows if r["admission"] == "optimistic" and r["protect"] != "none"), None
    )
    if base is None:
        return {}
    return {
        row_name(r): {
            "throughput_change": r["total_tok_s"] / base["total_tok_s"] - 1.0,
            "duration_change": r["duration_s"] / base["duration_s"] - 1.0,
            "mean_ttft_change": r["ttft_ms"]["mean"] / base["ttft_ms"]["mean"] - 1.0,
        }
        for r in rows
    }


def print_rows(label: str, rows: list[dict[str, Any]]) -> None:
    ratios = compare(rows)
    print(f"-- requests at {label}")
    print(
        f"{'admission':27s} {'conc@max':>8s} {'@prompt':>7s} {'peak':>4s} {'mean':>5s} "
        f"{'out tok/s':>9s} {'tot tok/s':>9s} {'dur s':>7s} {'TTFT ms':>8s} {'p99':>8s} "
        f"{'preempt':>7s} {'garbled':>9s} {'hazards':>7s} {'vs optimistic':>26s} {'wall s':>6s}"
    )
    for r in rows:
        name = row_name(r)
        rel = ratios.get(name)
        vs = (
            f"{rel['throughput_change']:+.1%} tok/s {rel['duration_change']:+.0%} dur"
            if rel
            else ""
        )
        print(
            f"{name:27s} {r['max_concurrency_at_max_len']:8d} "
            f"{r['max_concurrency_at_prompt_len']:7d} {r['peak_running']:4d} "
            f"{r['mean_running']:5.1f} {r['output_tok_s']:9.0f} {r['total_tok_s']:9.0f} "
            f"{r['duration_s']:7.3f} {r['ttft_ms']['mean']:8.1f} {r['ttft_ms']['p99']:8.1f} "
            f"{r['preemptions']:7d} {r['garbled']:4d}/{r['requests']:<4d} {r['hazards']:7d} "
            f"{vs:>26s} {r['wall_s']:6.1f}",
            flush=True,
        )


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Four panels per policy and workload: throughput against `optimistic`, mean TTFT, mean
    running requests, and sanitizer hazards labelled with the garbled completions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row_name(r) for r in results[0]["rows"]]

    def change(res: dict[str, Any]) -> Callable[[dict[str, Any]], float]:
        return lambda r: (
            100 * res["vs_optimistic"].get(row_name(r), {}).get("throughput_change", 0.0)
        )

    panels: tuple[tuple[str, Callable[[dict[str, Any]], Callable[[dict[str, Any]], float]]], ...]
    panels = (
        ("tokens/s vs optimistic (%, modelled device time)", change),
        ("mean TTFT (modelled ms)", lambda res: lambda r: r["ttft_ms"]["mean"]),
        ("mean running requests", lambda res: lambda r: r["mean_running"]),
        ("sanitizer hazards (label: garbled)", lambda res: lambda r: r["hazards"]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.8))
    width = 0.8 / len(results)
    for k, (ax, (title, value_of)) in enumerate(zip(axes, panels, strict=True)):
        for i, res in enumerate(results):
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(names))]
            value = value_of(res)
            label = f"requests at {res['fraction']:.0%} of max length"
            bars = ax.bar(xs, [value(r) for r in res["rows"]], width=width, label=label)
            if k == len(panels) - 1:
                garbled = [f"{r['garbled']}/{r['requests']}" for r in res["rows"]]
                ax.bar_label(bars, garbled, fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_title(title, fontsize=10)
        ax.axhline(0, color="black", linewidth=0.6)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=9)
    fig.suptitle(
        "kvtier bench admission: shared reserve vs per-request (vLLM after its fix) vs "
        "optimistic (before), sim device",
        x=0.4,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
