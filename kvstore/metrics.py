"""Store metrics: Prometheus series in a registry of the store's own, plus a JSON `stats()` snapshot.

Counters the store drives (hits, misses, corrupt blobs, bytes moved, latency) are prometheus_client
objects. Figures a tier keeps itself (usage, capacity, keys, evictions, errors, dropped puts) are read
from the tiers at scrape time by a collector, so they can never drift from the tiers' own books.
Never the global default registry: two stores in one process must not collide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.miss_log import MISS_REASONS
from kvstore.tiers.base import DROP_REASONS, Tier

LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


class _TierCollector(Collector):
    def __init__(self, metrics: StoreMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        usage = GaugeMetricFamily("kvstore_bytes", "Blob bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvstore_capacity_bytes", "Byte capacity per tier", labels=["tier"])
        keys = GaugeMetricFamily("kvstore_keys", "Blobs held per tier", labels=["tier"])
        ev = CounterMetricFamily("kvstore_evictions", "LRU evictions per tier", labels=["tier"])
        exp = CounterMetricFamily("kvstore_expired", "Blobs dropped by TTL per tier", labels=["tier"])
        err = CounterMetricFamily("kvstore_tier_errors", "Backend failures per tier", labels=["tier"])
        drop = CounterMetricFamily(
            "kvstore_dropped_writes",
            "Writes a tier did not store, by reason (no_space, no_fds, io_error, unavailable, too_large, "
            "queue_full...)",
            labels=["tier", "reason"],
        )
        for t in m.tiers:
            usage.add_metric([t.name], t.usage())
            cap.add_metric([t.name], t.capacity)
            keys.add_metric([t.name], len(t))
            ev.add_metric([t.name], t.stats.evictions)
            exp.add_metric([t.name], t.stats.expired)
            err.add_metric([t.name], t.stats.errors + m.store_errors[t.name])
        for (tier, reason), n in sorted(m.store_drops.items()):
            drop.add_metric([tier, reason], n)
        inval = GaugeMetricFamily(
            "kvstore_invalidated_keys",
            "Keys a tier could not reach to delete or replace, waiting to be deleted there (never served)",
            labels=["tier"],
        )
        spill = GaugeMetricFamily(
            "kvstore_spilled_bytes",
            "Bytes of blobs the cpu tier keeps outside its shared arena (no free region was large enough)",
            labels=["tier"],
        )
        for t in m.tiers:
            inval.add_metric([t.name], t.stats.extra.get("invalidated", 0))
            spill.add_metric([t.name], t.stats.extra.get("spilled_bytes", 0))
        yield from (usage, cap, keys, ev, exp, err, drop, inval, spill)
        yield from _cluster_families(m.tiers)


def _cluster_families(tiers: Sequence[Tier]) -> Iterator[Metric]:
    """A tier's own client counters (the redis tier's, kvstore/tiers/redis/servers.py CLUSTER_COUNTERS),
    for the tiers that keep them."""
    redirects = CounterMetricFamily(
        "kvstore_cluster_redirects",
        "Cluster redirects followed: ask (a migrating slot, the map unchanged), moved (a new owner)",
        labels=["tier", "kind"],
    )
    refreshes = CounterMetricFamily(
        "kvstore_cluster_map_refreshes", "Cluster slot-map refreshes", labels=["tier"]
    )
    fast = CounterMetricFamily(
        "kvstore_tier_fast_fails",
        "Calls a tier's circuit breaker refused without touching the network (a server down or failing over)",
        labels=["tier"],
    )
    for t in tiers:
        extra = t.stats.extra
        for kind in ("ask", "moved"):
            if kind in extra:
                redirects.add_metric([t.name, kind], extra[kind])
        if "map_refreshes" in extra:
            refreshes.add_metric([t.name], extra["map_refreshes"])
        if "fast_fails" in extra:
            fast.add_metric([t.name], extra["fast_fails"])
    yield from (redirects, refreshes, fast)


class TierCounters:
    """The store-driven counters of one tier (prometheus children, so incrementing is cheap)."""

    def __init__(self, m: StoreMetrics, tier: str) -> None:
        self.hits = m.hits.labels(tier=tier)
        self.misses = m.tier_misses.labels(tier=tier)
        self.corrupt = m.corrupt.labels(tier=tier)
        self.read_bytes = m.read_bytes.labels(tier=tier)
        self.written_bytes = m.written_bytes.labels(tier=tier)


class StoreMetrics:
    """Everything a TieredStore counts. Thread-safe (prometheus_client objects lock themselves)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = list(tiers)
        # KV events (kvstore.store_events.StoreEvents): told, per tier, the keys each put stored and evicted
        # and the keys each delete removed (kvstore.tier_calls calls it); None = off
        self.events: Callable[[str, list[str], list[str]], None] | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter(
            "kvstore_hits", "Reads served, by the tier that had the blob", ["tier"], registry=r
        )
        self.tier_misses = Counter(
            "kvstore_tier_misses", "Reads a tier could not serve", ["tier"], registry=r
        )
        self.misses = Counter("kvstore_misses", "Reads no tier could serve", registry=r)
        reasons = Counter(
            "kvstore_miss_reasons",
            "Reads no tier served and prefix lookups cut short, by why (kvstore/miss_log.py)",
            ["reason"],
            registry=r,
        )
        self.miss_reason = {reason: reasons.labels(reason=reason) for reason in MISS_REASONS}
        self.corrupt = Counter(
            "kvstore_corrupt_blobs", "Blobs that failed verification on read (deleted)", ["tier"], registry=r
        )
        self.read_bytes = Counter("kvstore_read_bytes", "Blob bytes served per tier", ["tier"], registry=r)
        self.written_bytes = Counter(
            "kvstore_written_bytes", "Blob bytes written per tier", ["tier"], registry=r
        )
        self.op_seconds = Histogram(
            "kvstore_op_seconds", "Store operation latency", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self._lock = threading.Lock()
        self.store_errors = {t.name: 0 for t in self.tiers}  # exceptions that escaped a tier
        # (tier, reason) -> writes it did not store; every pair exported from the start, at zero
        self.store_drops = {(t.name, r): 0 for t in self.tiers for r in DROP_REASONS}
        # labelled children resolved once: `.labels()` costs microseconds on every read otherwise
        self.tier = {t.name: TierCounters(self, t.name) for t in self.tiers}
        self._op: dict[str, Any] = {}
        r.register(_TierCollector(self))

    def count_error(self, tier: Tier) -> None:
        with self._lock:
            self.store_errors[tier.name] += 1

    def count_drop(self, tier: Tier, reason: str) -> None:
        with self._lock:
            self.store_drops[(tier.name, reason)] = self.store_drops.get((tier.name, reason), 0) + 1

    @contextmanager
    def time(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            child = self._op.get(op)
            if child is None:
                child = self._op[op] = self.op_seconds.labels(op=op)
            child.observe(time.perf_counter() - start)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when absent), e.g. value("kvstore_hits_total", tier="cpu")."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: per tier and overall (served at /v1/stats)."""
        samples: dict[tuple[str, str], float] = {}
        for metric in self.registry.collect():
            for s in metric.samples:  # summed over labels other than tier (the drop reasons)
                k = (s.name, s.labels.get("tier", ""))
                samples[k] = samples.get(k, 0.0) + s.value
        tiers = []
        for t in self.tiers:

            def g(name: str, tier: str = t.name) -> int:
                return int(samples.get((name, tier), 0))

            tiers.append({
                "name": t.name,
                "hits": g("kvstore_hits_total"),
                "misses": g("kvstore_tier_misses_total"),
                "bytes": g("kvstore_bytes"),
                "capacity": g("kvstore_capacity_bytes"),
                "keys": g("kvstore_keys"),
                "evictions": g("kvstore_evictions_total"),
                "expired": g("kvstore_expired_total"),
                "corrupt": g("kvstore_corrupt_blobs_total"),
                "errors": g("kvstore_tier_errors_total"),
                "dropped_writes": g("kvstore_dropped_writes_total"),
                "invalidated": g("kvstore_invalidated_keys"),
                "spilled_bytes": g("kvstore_spilled_bytes"),
                "read_bytes": g("kvstore_read_bytes_total"),
                "written_bytes": g("kvstore_written_bytes_total"),
            })  # fmt: skip
        hits = sum(t["hits"] for t in tiers)
        misses = int(samples.get(("kvstore_misses_total", ""), 0))
        lookups = hits + misses
        return {
            "tiers": tiers,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / lookups if lookups else 0.0,
            "miss_reasons": {
                r: int(self.value("kvstore_miss_reasons_total", reason=r)) for r in MISS_REASONS
            },
        }
