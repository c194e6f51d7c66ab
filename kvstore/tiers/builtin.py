"""The builders of the built-in tiers, which kvstore/tier_registry.py names ("kvstore.tiers.builtin:cpu")
with their declarations and settings blocks. Each imports its tier when called: the gpu and redis
tiers pull in their client libraries only when used."""

from __future__ import annotations

from kvstore.tier_registry import TierContext
from kvstore.tiers.base import Tier


def gpu(ctx: TierContext) -> Tier:
    from kvstore.tiers.gpu import GpuTier  # noqa: PLC0415

    return GpuTier(ctx.settings.capacity, clock=ctx.clock)


def cpu(ctx: TierContext) -> Tier:
    from kvstore.tiers.cpu import CpuTier  # noqa: PLC0415

    return CpuTier(ctx.settings.capacity, memory=ctx.settings.memory, clock=ctx.clock)


def disk(ctx: TierContext) -> Tier:
    from kvstore.tiers.disk import DiskTier  # noqa: PLC0415

    return DiskTier(ctx.settings.path, ctx.settings.capacity, clock=ctx.clock)


def redis(ctx: TierContext) -> Tier:
    from kvstore.tiers.redis import RedisTier  # noqa: PLC0415

    s = ctx.settings
    return RedisTier(
        s.url,
        prefix=s.prefix,
        cluster=s.cluster,
        max_invalidated=s.max_invalidated,
        handoff_dir=ctx.handoff_dir(f"{s.url}\0{s.prefix}"),
        wait_replicas=s.wait_replicas,
        clock=ctx.clock,
    )
