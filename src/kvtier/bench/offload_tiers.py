"""`kvtier bench offload --tiers device,host,disk,remote`: one configuration per tier added,
cumulative (device; + host; + disk; + remote), on the same workload, with a host tier smaller than the
workload (--host-fraction of every block of every conversation) and a disk tier of
--disk-fraction of their bytes (below 1, the remote tier serves what the disk evicted);
prompt-token shares by the tier that served them (architecture.md §Chain)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore

TIERS = ("device", "host", "disk", "remote")
FRAME_OVERHEAD = 256  # bytes a stored block adds to its payload (header, key), rounded up


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tiers",
        default=None,
        help="run one configuration per tier added, cumulative, from these (device,host,disk,"
        "remote; in that order) instead of host off vs on",
    )
    parser.add_argument(
        "--host-fraction",
        type=float,
        default=0.25,
        help="with --tiers: host tier as a fraction of every block of every conversation",
    )
    parser.add_argument(
        "--disk-fraction",
        type=float,
        default=1.0,
        help="with --tiers: disk tier size as a fraction of every block's bytes",
    )
    parser.add_argument(
        "--disk-path",
        default=None,
        help="with --tiers: the disk tier's folder (default: a temporary folder; emptied first)",
    )
    parser.add_argument(
        "--remote-url",
        default=None,
        help="with --tiers ...,remote: redis://host:port/db of an empty Redis (its keys stay)",
    )


def parse_tiers(args: argparse.Namespace) -> list[str]:
    """The --tiers list, checked: known names, in chain order, starting with device."""
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers or tiers[0] != "device" or tiers != sorted(tiers, key=TIERS.index):
        raise SystemExit(
            f"--tiers: give tiers of {','.join(TIERS)} in that order, starting with device; "
            f"got {args.tiers!r}"
        )
    if ("disk" in tiers or "remote" in tiers) and "host" not in tiers:
        raise SystemExit("--tiers: disk and remote stage their blocks through host; add host")
    if "remote" in tiers and not args.remote_url:
        raise SystemExit("--tiers ...,remote needs --remote-url redis://host:port/db")
    if not (args.host_fraction > 0 and args.disk_fraction > 0):
        raise SystemExit("--host-fraction and --disk-fraction must be positive")
    return tiers


def tier_configurations(
    tiers: list[str],
    args: argparse.Namespace,
    every: int,
    block_bytes: int,
    disk_path: str,
) -> list[tuple[str, dict[str, Any]]]:
    """[(name, engine keywords)]: "device", then "+host", "+disk", "+remote", each adding one
    tier to the one before; the host and disk tiers sized to their fractions of `every` blocks
    (every block of every conversation in every group) of `block_bytes` each."""
    configs: list[tuple[str, dict[str, Any]]] = [("device", {})]
    kw: dict[str, Any] = {}
    for tier in tiers[1:]:
        kw = dict(kw)
        if tier == "host":
            kw["num_host_blocks"] = max(8, int(every * args.host_fraction))
        elif tier == "disk":
            kw["kv_disk_path"] = disk_path
            size = every * args.disk_fraction * (block_bytes + FRAME_OVERHEAD)
            kw["kv_disk_size"] = size / (1 << 30)
        else:
            kw["kv_remote_url"] = args.remote_url
        configs.append((f"+{tier}", kw))
    return configs


def tier_hits(engine: EngineCore, external_tokens: int) -> dict[str, int]:
    """Prompt tokens each tier below the device served: the lower tiers' own counts, the host
    the rest of what was loaded (lower-tier hits reach the device through host blocks)."""
    stats = engine.stats()
    out = {}
    lower = 0
    for name in ("disk", "remote"):
        t = stats.tier(name)
        out[name] = 0 if t is None else t.metrics.num_hit_tokens
        lower += out[name]
    out["host"] = max(0, external_tokens - lower)
    return out


def tier_io(engine: EngineCore) -> dict[str, dict[str, int]]:
    """Per lower tier: blocks promoted (read into host blocks) and demoted (queued), dropped,
    the store's errors and timeouts."""
    out = {}
    for t in engine.stats().tiers:
        m, s = t.metrics, t.store
        out[t.name] = {
            "promoted_blocks": m.num_promoted_blocks,
            "demoted_blocks": m.num_demoted_blocks,
            "dropped_blocks": m.num_dropped_blocks + s.num_dropped,
            "errors": s.num_errors,
            "timeouts": s.num_timeouts,
        }
    return out
