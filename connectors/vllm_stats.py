"""kvstore in vLLM's own observability: connector stats, Prometheus metrics, cache-hit sources, KV events.

- `KVStoreConnectorStats` (vLLM's `KVConnectorStats`): each worker's counters since its last report
  (`get_kv_connector_stats`), summed over workers and intervals by vLLM, logged as "KV Transfer
  metrics: ..." and fed to `KVStorePromMetrics`. Only TP rank 0 of a stage reports (every rank loads
  the same tokens), and only the first PP stage counts tokens.
- `KVStorePromMetrics` (`build_prom_metrics`): in vLLM's /metrics, with vLLM's labels and `tier` (the
  store's tiers, e.g. `cpu` or `cpu+disk`): `vllm:kvstore_loaded_tokens`, `vllm:kvstore_load_bytes`,
  `vllm:kvstore_load_seconds` (histogram of load durations), `vllm:kvstore_load_errors`,
  `vllm:kvstore_saved_chunks`, `vllm:kvstore_save_bytes`.
- `hit_source(tiers)`: vLLM's `CacheHitSource` of a hit: HOST for a store whose tiers are memory only
  (cpu), DISK for one that keeps chunks on disk only; a store with several kinds of tier, or Redis, does
  not say which tier held a chunk: EXTERNAL_UNSPECIFIED.
- `stored_events` / `removed_events`: vLLM `BlockStored` / `BlockRemoved` events (medium "kvstore", a
  chunk per block, the first 8 bytes of its key as vLLM's 64-bit block hash) for the chunks the connector
  hands to its saver and the partial chunks those saves replace, for vLLM's KV-events stream
  (`take_events`). The store's own evictions are published by kvstore-server's KV events, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

COUNTERS = ("loaded_tokens", "load_bytes", "load_errors", "saved_chunks", "save_bytes")
# KVStoreConnectorStats key -> the kvstore_connector_* sample it is the delta of
SAMPLES = {
    "loaded_tokens": "kvstore_connector_loaded_tokens_total",
    "load_bytes": "kvstore_connector_load_bytes_total",
    "load_errors": "kvstore_connector_load_errors_total",
    "saved_chunks": "kvstore_connector_saved_chunks_total",
    "save_bytes": "kvstore_connector_save_bytes_total",
    "load_seconds_sum": "kvstore_connector_load_seconds_sum",
    "loads": "kvstore_connector_load_seconds_count",
}
MEDIUM = "kvstore"


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters (`SAMPLES`' keys, plus `tier`): sums over workers and intervals."""

    def reset(self) -> None:
        tier = self.data.get("tier")
        self.data = {"tier": tier} if tier else {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if k == "tier":
                self.data.setdefault("tier", v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS}
        loads = d.get("loads", 0)
        out["avg_load_ms"] = round(1e3 * d.get("load_seconds_sum", 0.0) / loads, 3) if loads else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k != "tier")


def samples(metrics: Any) -> dict[str, float]:
    """The samples `SAMPLES` reads, from just those metrics of a `ConnectorMetrics` (vLLM asks every
    step: a snapshot of the whole registry would cost the step milliseconds)."""
    out: dict[str, float] = {}
    for m in (metrics.loaded_tokens, metrics.load_bytes, metrics.load_errors, metrics.saved_chunks,
              metrics.save_bytes, metrics.load_seconds):  # fmt: skip
        for family in m.collect():
            for s in family.samples:
                out[s.name] = s.value
    return out


class StatsDelta:
    """A worker's `KVStoreConnectorStats` since its previous call, from its metrics' samples."""

    def __init__(self, tier: str, count_tokens: bool) -> None:
        self.tier = tier
        self.count_tokens = count_tokens
        self._last: dict[str, float] = {}

    def take(self, snapshot: dict[str, float]) -> KVStoreConnectorStats | None:
        data: dict[str, Any] = {}
        for key, sample in SAMPLES.items():
            now = snapshot.get(sample, 0.0)
            delta = now - self._last.get(key, 0.0)
            self._last[key] = now
            if delta and (key != "loaded_tokens" or self.count_tokens):
                data[key] = delta
        if not data:
            return None
        data["tier"] = self.tier
        return KVStoreConnectorStats(data=data)


class KVStorePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "tier"]
        counters = {
            "loaded_tokens": "Prompt tokens kvstore loaded into vLLM's KV cache",
            "load_bytes": "Bytes of chunks kvstore loaded",
            "load_errors": "Blocks kvstore could not load (recomputed)",
            "saved_chunks": "Chunks kvstore stored",
            "save_bytes": "Bytes of chunks kvstore stored",
        }
        self._counters = {
            k: self._counter_cls(f"vllm:kvstore_{k}", doc, labelnames=names) for k, doc in counters.items()
        }
        self._load_seconds = self._histogram_cls(
            "vllm:kvstore_load_seconds",
            "Mean duration of kvstore's loads in a stats interval",
            labelnames=names,
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [*self.per_engine_labelvalues.get(engine_idx, []), transfer_stats_data.get("tier", "store")]
        for key, counter in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter.labels(*labels).inc(value)
        loads = transfer_stats_data.get("loads", 0)
        if loads:
            self._load_seconds.labels(*labels).observe(
                transfer_stats_data.get("load_seconds_sum", 0.0) / loads
            )


def tier_label(tiers: Sequence[str]) -> str:
    return "+".join(tiers) if tiers else "store"


def hit_source(tiers: Sequence[str]) -> CacheHitSource:
    kinds = set(tiers)
    if kinds and kinds <= {"cpu", "gpu"}:
        return CacheHitSource.HOST
    if kinds == {"disk"}:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


def block_hash(key: str) -> int:
    """vLLM's 64-bit external block hash form of a chunk key (its first 8 bytes, big-endian)."""
    return int(key[:16], 16)


def stored_events(
    saves: Sequence[Any], parents: dict[str, str | None], tokens: dict[str, Sequence[int]], chunk_size: int
) -> list[KVCacheEvent]:
    """One BlockStored per saved chunk (`saves`: SaveSpec), its parent the previous chunk's key."""
    events: list[KVCacheEvent] = []
    for spec in saves:
        parent = parents.get(spec.key)
        toks = list(tokens.get(spec.key, ()))
        events.append(
            BlockStored(
                block_hashes=[block_hash(spec.key)],
                parent_block_hash=block_hash(parent) if parent else None,
                token_ids=toks,
                block_size=len(toks) or chunk_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                locality="REMOTE",
            )
        )
    return events


def removed_events(keys: Sequence[str]) -> list[KVCacheEvent]:
    if not keys:
        return []
    return [BlockRemoved(block_hashes=[block_hash(k) for k in keys], medium=MEDIUM, locality="REMOTE")]
