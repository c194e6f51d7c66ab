"""Calling a tier from the store: its typed failures become counters and errors, anything else it
raises (a broken Tier promise) is logged and counted and becomes a miss or a dropped write, so one
sick tier never takes the store down."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.metrics import StoreMetrics
from kvstore.protocol import Blob
from kvstore.tiers.base import TIER_ERROR, Tier, TierReadError, TierWriteError

logger = logging.getLogger("kvstore.store")
T = TypeVar("T")


def call(metrics: StoreMetrics, tier: Tier, what: str, fn: Callable[..., T], *args: Any, default: T) -> T:
    try:
        return fn(*args)
    except Exception:  # a tier broke its no-raise promise: count it, never let it take the store down
        logger.exception("tier %s failed in %s", tier.name, what)
        metrics.count_error(tier)
        return default


def put(
    metrics: StoreMetrics, tier: Tier, items: Sequence[tuple[str, bytes]], ttl: float | None
) -> tuple[list[str], TierWriteError | None]:
    """Write `items` into `tier`; count the bytes it stored and the writes it dropped (by reason).
    Returns (the keys it evicted, its error about the items it did not store or None)."""
    try:
        evicted, error = tier.put_many(items, ttl), None
    except TierWriteError as e:
        evicted, error = e.evicted, e
    except Exception as e:  # a tier broke its protocol
        logger.exception("tier %s failed in put", tier.name)
        metrics.count_error(tier)
        evicted = []
        error = TierWriteError(tier.name, dict.fromkeys((k for k, _ in items), TIER_ERROR), repr(e))
    failed = error.failed if error is not None else {}
    metrics.tier[tier.name].written_bytes.inc(sum(len(b) for k, b in items if k not in failed))
    for reason in failed.values():
        metrics.count_drop(tier, reason)
    if metrics.events is not None:
        metrics.events(tier.name, [k for k, _ in items if k not in failed], list(evicted))
    return evicted, error


def get_many(
    metrics: StoreMetrics, tier: Tier, keys: list[str], read_errors: dict[str, str]
) -> list[Blob | None]:
    """The tier's blobs for `keys`; a read error (a blob it holds but cannot read) goes to
    `read_errors` (key -> what happened) instead of passing for a miss."""
    try:
        return tier.get_many(keys)
    except TierReadError as e:
        metrics.count_error(tier)
        for key in e.failed:
            read_errors.setdefault(key, f"{tier.name}: {e.detail}")
        return e.blobs
    except Exception:  # a tier broke its protocol: a miss, counted
        logger.exception("tier %s failed in get", tier.name)
        metrics.count_error(tier)
        return [None] * len(keys)


def delete(metrics: StoreMetrics, tier: Tier, key: str) -> bool:
    """Delete from one tier; raises TierWriteError when it may still serve the key afterwards."""
    try:
        gone = bool(tier.delete(key))
        if gone and metrics.events is not None:
            metrics.events(tier.name, [], [key])
        return gone
    except TierWriteError as e:
        if key in e.stale:
            raise
        return False
    except Exception:  # a tier broke its protocol
        logger.exception("tier %s failed in delete", tier.name)
        metrics.count_error(tier)
        return False
