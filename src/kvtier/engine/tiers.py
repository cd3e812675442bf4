"""The tiers below the host, built from `CacheConfig` (`--kv-disk-path`, `--kv-disk-size`,
`--kv-remote-url`, `--kv-remote-ttl-s`, `--kv-tier-timeout-s`): their stores, the store layout of
each KV-cache group and the `TierChain` the scheduler talks to (architecture.md §Chain)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.config import CacheConfig
from kvtier.device import Device
from kvtier.offload.chain import TierChain
from kvtier.offload.fetch import LowerTier
from kvtier.offload.tier import HostTier
from kvtier.runner.host_io import LAYOUT_VERSION, HostBlockIO
from kvtier.stores import DiskStore, StoreLayout, model_fingerprint

log = logging.getLogger("kvtier.engine")


def build_chain(
    cache: CacheConfig, host: HostTier, device: Device, model_path: Path, dtype: str
) -> TierChain:
    """The chain over `host` and the disk and remote tiers `cache` names (at least one)."""
    fingerprint = model_fingerprint(model_path)
    layouts = [
        StoreLayout(fingerprint, LAYOUT_VERSION, dtype, spec.block_size) for spec in host.specs
    ]
    lowers: list[LowerTier] = []
    try:
        _add_stores(cache, lowers)
        log.info("KV tiers below the host keyed by model fingerprint %s", fingerprint)
        return TierChain(
            host, lowers, HostBlockIO(device), layouts, timeout_s=cache.kv_tier_timeout_s
        )
    except BaseException:
        for tier in lowers:  # never leave a disk folder locked by an engine that did not start
            tier.store.close()
        raise


def _add_stores(cache: CacheConfig, lowers: list[LowerTier]) -> None:
    if cache.kv_disk_path is not None:
        try:
            disk = DiskStore(cache.kv_disk_path, cache.disk_size_bytes)
        except ValueError as exc:
            raise ValueError(f"--kv-disk-path: {exc}") from None
        lowers.append(LowerTier("disk", disk, cheap_contains=True))
        log.info(
            "disk KV tier: %s, %.3g GiB (%d blocks found)",
            cache.kv_disk_path,
            cache.disk_size_bytes / (1 << 30),
            disk.num_blocks,
        )
    if cache.kv_remote_url is not None:
        try:  # the client is an extra: only an engine with a remote tier imports it
            from kvtier.stores.redis_store import RedisStore, redis_url
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"--kv-remote-url needs the Redis client ({exc.name} is not installed): "
                "pip install 'kvtier[redis]', or drop --kv-remote-url"
            ) from exc
        try:
            # A lookup waits --kv-tier-timeout-s in total: one Redis read never waits longer.
            remote = RedisStore(
                cache.kv_remote_url,
                get_timeout_s=cache.kv_tier_timeout_s,
                ttl_s=cache.kv_remote_ttl_s,
            )
        except ValueError as exc:
            raise ValueError(f"--kv-remote-url: {exc}") from None
        lowers.append(LowerTier("remote", remote, cheap_contains=False))
        log.info("remote KV tier: %s", redis_url(cache.kv_remote_url)[1])
