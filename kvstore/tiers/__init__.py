"""Tiers (docs/design.md §4): the kinds the registry knows (kvstore/tier_registry.py; gpu, cpu, disk,
redis and fs are built in, their builders in kvstore/tiers/builtin.py) and `make_tier`, which builds one
from a StoreConfig's settings."""

from __future__ import annotations

from typing import Any

from kvstore.clock import SYSTEM, Clock
from kvstore.tier_registry import BUILTIN, TierContext, TierSpec, register_tier, tier_spec, tier_specs
from kvstore.tiers.base import Tier, TierStats

TIER_NAMES = tuple(spec.name for spec in BUILTIN)  # the built-in ones; tier_specs() has them all


def make_tier(name: str, config: Any, clock: Clock = SYSTEM) -> Tier:
    """Build the registered tier `name` from its settings block in `config` (a StoreConfig), on `clock`
    (the store's). A tier that declares hinted handoff journals under `config.state_dir`."""
    spec = tier_spec(name)  # ConfigError naming the known tiers
    ctx = TierContext(name, config.tier(name), clock, config.state_dir if spec.handoff else None)
    tier = spec.builder()(ctx)
    if getattr(tier, "kind", None) is None:
        try:
            tier.kind = name  # what kvstore.tier_registry.spec_of() looks up
        except AttributeError:
            pass
    return tier


__all__ = [
    "TIER_NAMES",
    "Tier",
    "TierContext",
    "TierSpec",
    "TierStats",
    "make_tier",
    "register_tier",
    "tier_specs",
]
