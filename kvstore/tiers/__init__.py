"""Tiers: gpu, cpu, disk, redis (docs/design.md §4). `make_tier` builds one by name from a StoreConfig."""

from __future__ import annotations

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.tiers.base import Tier, TierStats

TIER_NAMES = ("gpu", "cpu", "disk", "redis")


def make_tier(name: str, config: StoreConfig) -> Tier:
    """Build the tier called `name` (one of TIER_NAMES) with its settings from `config`."""
    # imported lazily: the gpu and redis tiers pull in their client libraries only when used
    if name == "cpu":
        from kvstore.tiers.cpu import CpuTier  # noqa: PLC0415

        return CpuTier.from_config(config)
    if name == "disk":
        from kvstore.tiers.disk import DiskTier  # noqa: PLC0415

        return DiskTier.from_config(config)
    if name == "redis":
        from kvstore.tiers.redis import RedisTier  # noqa: PLC0415

        return RedisTier.from_config(config)
    if name == "gpu":
        from kvstore.tiers.gpu import GpuTier  # noqa: PLC0415

        return GpuTier.from_config(config)
    raise ConfigError(f"unknown tier {name!r}; known: {', '.join(TIER_NAMES)}")


__all__ = ["Tier", "TierStats", "TIER_NAMES", "make_tier"]
