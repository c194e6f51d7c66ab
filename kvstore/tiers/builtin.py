"""The builders of the built-in tiers, which kvstore/tier_registry.py names ("kvstore.tiers.builtin:cpu")
with their declarations and settings blocks. Each imports its tier when called: the gpu and redis
tiers pull in their client libraries only when used."""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import ConfigError
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


def fs(ctx: TierContext) -> Tier:
    from kvstore.tiers.fs import FsTier  # noqa: PLC0415

    s = ctx.settings
    if s.path is None:
        raise ConfigError(
            "the fs tier needs the directory the servers share: fs_path (--fs-path, KVSTORE_FS_PATH)"
        )
    return FsTier(
        s.path,
        s.capacity,
        max_age=s.max_age,
        sweep_interval=s.sweep_interval,
        fsync=s.fsync,
        max_invalidated=s.max_invalidated,
        handoff_dir=ctx.handoff_dir(str(Path(s.path).resolve())),
        clock=ctx.clock,
    )
