"""A ring buffer of periodic samples, served at /v1/stats/history for the dashboard.

One sample (counters are cumulative; the page turns them into rates, ratios and percentiles over
whatever window it shows, treating a drop as a counter reset):

    {"t": unix seconds,
     "tiers": {name: {hits, misses, bytes, capacity, keys, evictions, expired, corrupt, errors,
               read_bytes, written_bytes}},
     "misses": reads no tier served, "miss_reasons": {not_stored, evicted, expired, corrupt, unreachable},
     "requests": n, "errors": n,
     "lookups": prefix lookups, "lookups_cut_short": those a missing key cut short (not in "misses"),
     "latency": {"get" | "put" | "lookup" | "get (same host)": [cumulative count per bucket of
                 LATENCY_BUCKETS, ..., +Inf]},
     "engines": {prompt_tokens, engine_hit_tokens, store_hit_tokens, prefill_seconds, ...,
                 "by_url": {metrics URL: the same fields of that engine alone, or None: it was down}}
                or absent}
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore.server.engine_scrape import EngineScraper
from kvstore.server.metrics import BUCKETS
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)
LATENCY_OPS = {"get": ("get", "batch_get"), "put": ("put", "batch_put"), "lookup": ("lookup", "batch_exists")}
# Gets a same-host client served itself from the arena (in place or copied, by the index) and reported
# with TOUCH: not requests the server measured, so a group of their own
REPORTED_GETS = "get (same host)"
LATENCY_BUCKETS = [*BUCKETS, math.inf]
_TIER_FIELDS = ("hits", "misses", "bytes", "capacity", "keys", "evictions", "expired", "corrupt", "errors",
                "read_bytes", "written_bytes")  # fmt: skip


def summarize(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per-tier counters the dashboard plots, from `TieredStore.stats()`."""
    out: dict[str, dict[str, float]] = {}
    tiers = stats.get("tiers") or []
    if isinstance(tiers, dict):
        tiers = [dict(t, name=n) for n, t in tiers.items()]
    for tier in tiers:
        out[str(tier.get("name", "?"))] = {f: float(tier.get(f, 0)) for f in _TIER_FIELDS}
    return out


def latency_buckets(registry: CollectorRegistry | None) -> dict[str, list[float]]:
    """Cumulative bucket counts of the server's request latency, per dashboard op group."""
    out = {group: [0.0] * len(LATENCY_BUCKETS) for group in (*LATENCY_OPS, REPORTED_GETS)}
    if registry is None:
        return out
    index = {le: i for i, le in enumerate(LATENCY_BUCKETS)}
    group_of = {op: g for g, ops in LATENCY_OPS.items() for op in ops}
    for family in registry.collect():
        if family.name not in ("kvstore_request_seconds", "kvstore_reported_get_seconds"):
            continue
        reported = family.name == "kvstore_reported_get_seconds"
        for s in family.samples:
            group = REPORTED_GETS if reported else group_of.get(s.labels.get("op", ""))
            if group is None or not s.name.endswith("_bucket"):
                continue
            i = index.get(float(s.labels["le"]))
            if i is not None:
                out[group][i] += s.value
    return out


class StatsHistory:
    """The last `size` samples; `engine_urls` are engines whose /metrics each sample reads."""

    def __init__(self, size: int, engine_urls: list[str] | None = None) -> None:
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self.engines = EngineScraper(engine_urls or [])

    def add(
        self,
        stats: dict[str, Any],
        totals: dict[str, float],
        registry: CollectorRegistry | None = None,
        engines: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        sample: dict[str, Any] = {
            "t": round(time.time(), 3),
            "tiers": summarize(stats),
            "misses": float(stats.get("misses", 0)),
            "miss_reasons": {k: float(v) for k, v in (stats.get("miss_reasons") or {}).items()},
            "requests": totals.get("requests", 0),
            "errors": totals.get("errors", 0),
            "lookups": totals.get("lookups", 0),
            "lookups_cut_short": totals.get("lookups_cut_short", 0),
            "latency": latency_buckets(registry),
        }
        if engines is not None:
            sample["engines"] = engines
        self.samples.append(sample)
        return sample

    def as_list(self, since: float | None = None) -> list[dict[str, Any]]:
        return [s for s in self.samples if since is None or s["t"] > since]

    async def run(
        self,
        interval: float,
        sample: Callable[[], Awaitable[dict[str, Any]]],
        totals: Callable[[], dict[str, float]],
        registry: CollectorRegistry | None = None,
    ) -> None:
        """Sample until cancelled. `sample` is an async callable returning `store.stats()`."""
        try:
            while True:
                try:
                    stats, engines = await asyncio.gather(sample(), self.engines.scrape())
                    self.add(stats, totals(), registry, engines)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a failed sample must never kill the sampler; the next one may work
                    log.exception("sampling store stats failed")
                await asyncio.sleep(interval)
        finally:
            await self.engines.close()
