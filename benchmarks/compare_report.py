"""Ratios ours / theirs for `kvtier bench compare`: one row per metric and setting from the
per-round values of both engines, the table it prints, and the optional PNG."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def ratio_row(
    metric: str,
    setting: str,
    ours: list[float],
    theirs: list[float],
    better: str,
    target: float | None = None,
    caveat: str | None = None,
) -> dict[str, Any]:
    """Round i of ours is paired with round i of theirs (run back to back); the ratio reported is
    the median of the paired ratios, with their min and max as the spread. `better` is "higher"
    or "lower"; a target is met when the median ratio is on its better side (inclusive). A
    `caveat` says why the values do not compare (the target then neither met nor missed)."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    if not ours or len(ours) != len(theirs):
        raise ValueError(f"{metric} {setting}: need equal, non-empty rounds ({ours}, {theirs})")
    if min(theirs) <= 0 or min(ours) <= 0:
        raise ValueError(f"{metric} {setting}: values must be positive ({ours}, {theirs})")
    paired = [a / b for a, b in zip(ours, theirs, strict=True)]
    ratio = statistics.median(paired)
    met = None
    if target is not None and caveat is None:
        met = ratio >= target if better == "higher" else ratio <= target
    return {
        "metric": metric,
        "setting": setting,
        "better": better,
        "ours": ours,
        "theirs": theirs,
        "ours_median": statistics.median(ours),
        "theirs_median": statistics.median(theirs),
        "ratios": paired,
        "ratio": ratio,
        "ratio_min": min(paired),
        "ratio_max": max(paired),
        "target": target,
        "meets_target": met,
        "caveat": caveat,
    }


def merge(paths: list[Path]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The rows of saved runs (the JSON each `bench compare --out` wrote), in order, each
    recomputed from its rounds by `ratio_row`, and each run's peer (a merged file's: each of its
    runs'): a comparison run in parts (offline here, serving there) becomes one table and one
    PNG. A row whose metric and setting an earlier file has gets its file's name after the
    setting. ValueError naming the file on anything else."""
    rows: list[dict[str, Any]] = []
    peers: list[Any] = []
    seen: set[tuple[str, str]] = set()
    fix = "pass the JSON files `kvtier bench compare --out` saved"
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"--merge {path}: cannot read it ({exc.strerror}); {fix}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--merge {path}: not JSON ({exc}); {fix}") from None
        saved = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(saved, list) or not saved:
            raise ValueError(f"--merge {path}: no rows of a comparison; {fix}")
        merged = data.get("peers")  # a merge's JSON: its files' peers, kept for a merge of merges
        if isinstance(merged, list):
            peers.extend(merged)
        else:
            peers.append(data.get("peer"))
        for r in saved:
            try:
                row = ratio_row(r["metric"], r["setting"], r["ours"], r["theirs"], r["better"],
                                r["target"], r.get("caveat"))  # fmt: skip
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"--merge {path}: a row is not a comparison's ({exc}); {fix}"
                ) from None
            if (row["metric"], row["setting"]) in seen:
                row["setting"] = f"{row['setting']} ({Path(path).stem})"
            seen.add((row["metric"], row["setting"]))
            rows.append(row)
    return rows, peers


def _target(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return ""
    sign = "≥" if row["better"] == "higher" else "≤"
    if row.get("caveat"):
        return f"{sign}{row['target']:.1f} n/c (not comparable, below)"
    return f"{sign}{row['target']:.1f} {'met' if row['meets_target'] else 'MISSED'}"


def render(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: metric, setting, medians of both engines, ratio [min–max], target."""
    head = f"{'metric':28} {'setting':34} {'kvtier':>10} {'vLLM':>10}  {'ours/theirs':>24}  target"
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{r['ratio']:.2f} [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}]"
        lines.append(
            f"{r['metric']:28} {r['setting']:34} {r['ours_median']:10.4g} "
            f"{r['theirs_median']:10.4g}  {spread:>24}  {_target(r)}"
        )
    lines += [f"n/c {r['metric']}, {r['setting']}: {r['caveat']}" for r in rows if r.get("caveat")]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> Path:
    """Horizontal bars of the ratio per row (log scale, whiskers min–max, a line at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['metric']} · {r['setting']}" for r in rows]
    ratios = [r["ratio"] for r in rows]
    err = [
        [r["ratio"] - r["ratio_min"] for r in rows],
        [r["ratio_max"] - r["ratio"] for r in rows],
    ]
    good = [(r["ratio"] >= 1) == (r["better"] == "higher") for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) + 1.5))
    ys = list(range(len(rows)))
    colors = [
        "tab:gray" if r.get("caveat") else "tab:green" if g else "tab:red"
        for r, g in zip(rows, good)
    ]
    ax.barh(ys, ratios, xerr=err, color=colors)
    for y, r in zip(ys, ratios):
        ax.annotate(f"{r:.2f}", (r, y), xytext=(3, -3), textcoords="offset points", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "kvtier / vLLM (green: kvtier better; grey: not comparable; whiskers: min–max over rounds)"
    )
    ax.set_title(title, fontsize=9)
    # the labels' column as wide as the longest label (a sampled run's settings are long), the
    # bars keep their 6.6 inches
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    label_in = max(t.get_window_extent(renderer).width for t in ax.get_yticklabels()) / fig.dpi
    label_in = 1.1 * label_in + 0.3  # the ticks' pad, and text drawn at the saving dpi
    width = max(11.0, label_in + 6.6 / 0.97)
    fig.set_size_inches(width, fig.get_figheight())
    fig.subplots_adjust(
        left=label_in / width,
        right=0.97,
        top=1 - 0.5 / fig.get_figheight(),
        bottom=0.6 / fig.get_figheight(),
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
