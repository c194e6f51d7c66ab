"""A ring buffer of periodic store samples, served at /v1/stats/history for the dashboard."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def summarize(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per-tier counters the dashboard plots, from `TieredStore.stats()`.

    Counters are cumulative; the page turns them into rates and hit ratios between samples.
    """
    out: dict[str, dict[str, float]] = {}
    tiers = stats.get("tiers") or []
    if isinstance(tiers, dict):
        tiers = [dict(t, name=n) for n, t in tiers.items()]
    for tier in tiers:
        name = str(tier.get("name", "?"))
        out[name] = {
            "hits": float(tier.get("hits", 0)),
            "misses": float(tier.get("misses", 0)),
            "bytes": float(tier.get("bytes", tier.get("usage", 0))),
            "capacity": float(tier.get("capacity", 0)),
            "evictions": float(tier.get("evictions", 0)),
            "keys": float(tier.get("keys", 0)),
        }
    return out


class StatsHistory:
    """The last `size` samples: `{"t": unix seconds, "tiers": {...}, "requests": n, "errors": n}`."""

    def __init__(self, size: int) -> None:
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)

    def add(self, stats: dict[str, Any], totals: dict[str, int]) -> dict[str, Any]:
        sample = {
            "t": round(time.time(), 3),
            "tiers": summarize(stats),
            "requests": totals.get("requests", 0),
            "errors": totals.get("errors", 0),
        }
        self.samples.append(sample)
        return sample

    def as_list(self, since: float | None = None) -> list[dict[str, Any]]:
        return [s for s in self.samples if since is None or s["t"] > since]

    async def run(
        self, interval: float, sample: Callable[[], Any], totals: Callable[[], dict[str, int]]
    ) -> None:
        """Sample until cancelled. `sample` is an async callable returning `store.stats()`."""
        while True:
            try:
                self.add(await sample(), totals())
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed sample must never kill the sampler; the next one may work
                log.exception("sampling store stats failed")
            await asyncio.sleep(interval)
