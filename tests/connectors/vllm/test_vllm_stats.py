"""vLLM's observability hooks of KVStoreConnectorV1 without an engine: its stats sum over workers and
intervals and reach vLLM's Prometheus registry under vLLM's labels, the CacheHitSource of a hit follows
the store's tiers, its KV events are vLLM's, and vLLM's second update_state_after_alloc of an async load
counts nothing twice."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from kvstore.connectors.vllm_stats import (  # noqa: E402
    KVStoreConnectorStats,
    KVStorePromMetrics,
    StatsDelta,
    block_hash,
    hit_source,
    removed_events,
    stored_events,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402


def test_stats_are_deltas_summed_over_workers_and_reach_prometheus() -> None:
    delta = StatsDelta("cpu", count_tokens=True)
    snap = {"kvstore_connector_loaded_tokens_total": 512, "kvstore_connector_load_bytes_total": 1000,
            "kvstore_connector_load_seconds_sum": 0.02, "kvstore_connector_load_seconds_count": 2}  # fmt: skip
    first = delta.take(snap)
    assert first.data["loaded_tokens"] == 512 and first.data["tier"] == "cpu"
    assert delta.take(snap) is None  # nothing new
    snap["kvstore_connector_loaded_tokens_total"] = 768
    second = delta.take(snap)
    assert second.data == {"loaded_tokens": 256, "tier": "cpu"}
    other = StatsDelta("cpu", count_tokens=False).take(snap)  # another PP stage: bytes, not tokens
    assert "loaded_tokens" not in other.data
    total = KVStoreConnectorStats(data=dict(first.data)).aggregate(second).aggregate(other)
    assert total.reduce()["loaded_tokens"] == 768 and total.reduce()["avg_load_ms"] == 10.0
    assert not total.is_empty()
    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=registry, **kw)

        return Bound

    class Cfg:
        kv_transfer_config = None

    prom = KVStorePromMetrics(Cfg(), {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
                              ["model_name", "engine"], {0: ["m", "0"]})  # fmt: skip
    prom.observe(total.data, 0)
    labels = {"model_name": "m", "engine": "0", "tier": "cpu"}
    assert registry.get_sample_value("vllm:kvstore_loaded_tokens_total", labels) == 768
    assert registry.get_sample_value("vllm:kvstore_load_seconds_count", labels) == 1


def test_hit_sources_follow_the_stores_tiers() -> None:
    assert hit_source(["cpu"]) is CacheHitSource.HOST
    assert hit_source(["disk"]) is CacheHitSource.DISK
    assert hit_source(["cpu", "disk"]) is CacheHitSource.EXTERNAL_UNSPECIFIED
    assert hit_source([]) is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_kv_events_are_vllms() -> None:
    from kvstore.connectors.meta import SaveSpec  # noqa: PLC0415
    from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: PLC0415

    k0, k1 = "0123456789abcdef" * 2, "fedcba9876543210" * 2
    (ev,) = stored_events([SaveSpec("r", k1, 1, (3, 4))], {k1: k0}, {k1: list(range(256))}, 256)
    assert (
        isinstance(ev, BlockStored)
        and ev.block_hashes == [block_hash(k1)]
        and ev.parent_block_hash == block_hash(k0)
    )
    assert ev.medium == "kvstore" and ev.block_size == 256 and block_hash(k0) == 0x0123456789ABCDEF
    (gone,) = removed_events([k0])
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [block_hash(k0)]
