"""Connector metrics, with the names vLLM and LMCache users already graph.

Tokens, not requests: `vllm:external_prefix_cache_queries` counts the tokens of every request the
scheduler asked the store about, `vllm:external_prefix_cache_hits` the tokens the store provided.
Requests resumed after a preemption are counted apart (`*_preempted_*`), so recomputing one's own
KV never inflates the hit rate.

Chunk misses by reason, as the store reports each miss (kvstore/miss_log.py) plus what only the
connector sees:
- `not_stored`   the store never had the chunk (or forgot it was written)
- `evicted`      stored, then evicted to make room (also: found by the lookup, gone at the load)
- `expired`      stored, then dropped by its TTL
- `corrupt`      the blob failed verification in the store, or arrived but did not verify, decode, or
                 match this engine's layout
- `unreachable`  the store (or one of its tiers) did not answer: connection refused, timeout, error
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

MISS_REASONS = ("not_stored", "evicted", "expired", "corrupt", "unreachable")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.queries = Counter(
            "vllm:external_prefix_cache_queries", "Tokens looked up in the external KV store", registry=r
        )
        self.hits = Counter(
            "vllm:external_prefix_cache_hits", "Tokens the external KV store provided", registry=r
        )
        self.preempted_queries = Counter(
            "kvstore_connector_preempted_queries",
            "Tokens of resumed (preempted) requests looked up",
            registry=r,
        )
        self.preempted_hits = Counter(
            "kvstore_connector_preempted_hits", "Tokens of resumed (preempted) requests loaded", registry=r
        )
        self.chunk_misses = Counter(
            "kvstore_connector_chunk_misses", "Chunks not loaded, by reason", ["reason"], registry=r
        )
        self.lookup_seconds = Histogram(
            "kvstore_connector_lookup_seconds", "One prefix lookup round trip", buckets=_SECONDS, registry=r
        )
        self.load_bytes = Counter(
            "kvstore_connector_load_bytes", "Blob bytes loaded from the store", registry=r
        )
        self.loaded_tokens = Counter(
            "kvstore_connector_loaded_tokens",
            "Tokens written into the paged cache from the store",
            registry=r,
        )
        self.load_seconds = Histogram(
            "kvstore_connector_load_seconds",
            "Fetch+decode+scatter of a request's chunks (per step when loads are synchronous)",
            buckets=_SECONDS,
            registry=r,
        )
        self.load_errors = Counter(
            "kvstore_connector_load_error_blocks", "Blocks whose load failed (recomputed)", registry=r
        )
        self.save_bytes = Counter("kvstore_connector_save_bytes", "Blob bytes saved to the store", registry=r)
        self.saved_chunks = Counter("kvstore_connector_saved_chunks", "Chunks saved to the store", registry=r)
        self.skipped_saves = Counter(
            "kvstore_connector_skipped_saves", "Chunks not saved because the store had them", registry=r
        )
        self.dropped_saves = Counter(
            "kvstore_connector_dropped_saves",
            "Chunks not saved: save queue full or store failed",
            ["reason"],
            registry=r,
        )
        self.partial_chunks = Counter(
            "kvstore_connector_partial_chunks",
            "Partial (trailing) chunks: saved, loaded, or replaced by a longer one",
            ["event"],
            registry=r,
        )
        self.save_seconds = Histogram(
            "kvstore_connector_save_seconds", "Encode+put of one step's chunks", buckets=_SECONDS, registry=r
        )
        self.copy_out_seconds = Histogram(
            "kvstore_connector_copy_out_seconds",
            "Gathering blocks into chunks in wait_for_save (engine-visible)",
            buckets=_SECONDS,
            registry=r,
        )
        self.pending_saves = Gauge(
            "kvstore_connector_pending_saves", "Chunks copied out, waiting for the store", registry=r
        )
        for reason in MISS_REASONS:
            self.chunk_misses.labels(reason)
        for reason in ("queue_full", "store_error"):
            self.dropped_saves.labels(reason)
        for event in ("saved", "loaded", "replaced"):
            self.partial_chunks.labels(event)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int, preempted: bool) -> None:
        assert 0 <= num_hit_tokens <= num_tokens
        if preempted:
            self.preempted_queries.inc(num_tokens)
            self.preempted_hits.inc(num_hit_tokens)
        else:
            self.queries.inc(num_tokens)
            self.hits.inc(num_hit_tokens)

    def miss(self, reason: str, chunks: int = 1) -> None:
        assert reason in MISS_REASONS, reason
        if chunks > 0:
            self.chunk_misses.labels(reason).inc(chunks)

    def render(self, model_name: str) -> bytes:
        """Prometheus text of these metrics with a `model_name` label on every sample (as vLLM's)."""
        labelled = CollectorRegistry()
        labelled.register(_WithLabel(self.registry, "model_name", model_name))
        return generate_latest(labelled)

    def snapshot(self) -> dict[str, float]:
        """Flat name -> value map of every sample (tests and the demo print it)."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith(("_bucket", "_created")):
                    continue
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}" if label else s.name] = s.value
        return out

    @property
    def hit_rate(self) -> float:
        snap = self.snapshot()
        q = snap.get("vllm:external_prefix_cache_queries_total", 0.0)
        return snap.get("vllm:external_prefix_cache_hits_total", 0.0) / q if q else 0.0


class _WithLabel(Collector):
    """Another registry's metrics with one more label on every sample."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self._registry, self._name, self._value = registry, name, value

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(
                    s.name, {**s.labels, self._name: self._value}, s.value, s.timestamp, s.exemplar
                )
            yield out
