"""Snapshots of a tier's blocks for inspection (`BlockPool.stats()`): plain frozen data, taken at
one moment; never a handle on the live pool. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One tier's blocks at a moment; the null block is not counted.

    `num_used` counts every referenced block, whoever holds it: request tables, the quarantine,
    copies in flight. The `*_pins` fields say how many references copies hold (filled by the
    engine from the host tier; 0 in a bare pool's snapshot).
    """

    medium: str  # "device" or "host"
    num_blocks: int  # usable blocks
    num_free: int  # allocatable now (unreferenced, prefix-cache entries among them)
    num_used: int  # referenced: num_blocks − num_free
    num_cached: int  # prefix-cache entries, referenced or not
    num_quarantined_refs: int  # references the quarantine holds
    # (release step, references) ascending: held until that step is processed
    quarantined_refs_by_step: tuple[tuple[int, int], ...] = ()
    num_load_pins: int = 0  # references held by loads (device: destinations; host: sources)
    num_store_pins: int = 0  # references held by stores (device: sources; host: destinations)

    @property
    def usage(self) -> float:
        """Fraction of the blocks not free (as `BlockPool.usage`)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def is_idle(self) -> bool:
        """No block referenced: every block is free or an unreferenced prefix-cache entry."""
        return self.num_used == 0 and self.num_quarantined_refs == 0
