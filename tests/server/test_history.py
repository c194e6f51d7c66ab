"""The dashboard's samples: store counters, latency buckets, miss reasons and the engines' metrics."""

from __future__ import annotations

from aiohttp import web
from kvstore.connectors.metrics import ConnectorMetrics
from kvstore.engine.metrics import EngineMetrics
from kvstore.server.engine_scrape import EngineScraper, metrics_url, parse_engine_metrics
from kvstore.server.history import LATENCY_BUCKETS, StatsHistory
from kvstore.server.metrics import ServerMetrics


def engine_text(prompt: int, local: int, store: int) -> bytes:
    """Prometheus text exactly as kvstore-engine renders it (engine metrics, then the connector's)."""
    m = EngineMetrics("SmolLM2")
    m.update_scheduler_state(1, 2, 0.5, prompt, local, 3)
    m.request_prefill_time.observe(0.25)
    c = ConnectorMetrics()
    c.record_lookup(prompt, store, preempted=False)
    c.miss("expired", 2)
    return m.render() + c.render("SmolLM2")


def test_parse_engine_metrics_reads_vllm_names() -> None:
    got = parse_engine_metrics(engine_text(1000, 300, 512).decode())
    assert (got["prompt_tokens"], got["engine_hit_tokens"], got["store_hit_tokens"]) == (1000, 300, 512)
    assert got["prefill_seconds"] == 0.25 and got["prefills"] == 1
    assert (got["running"], got["waiting"], got["preemptions"]) == (1, 2, 3)
    assert got["chunk_misses_expired"] == 2
    assert metrics_url("http://e:8000/") == "http://e:8000/metrics" == metrics_url("http://e:8000/metrics")
    assert (got["prefill_prompt_tokens"], got["prefill_computed_tokens"]) == (0, 0)
    # an engine that does not say what its prefills computed: those fields are absent, not 0
    older = parse_engine_metrics(ConnectorMetrics().render("SmolLM2").decode())
    assert "prefill_computed_tokens" not in older and "prefill_prompt_tokens" not in older


def test_a_prefills_seconds_and_tokens_are_read_together() -> None:
    """Issue 43: kvstore-engine observes a prefill's prompt and computed tokens with its time, under
    vLLM's names (vLLM: when the request finishes), so the dashboard pairs them per request."""
    m = EngineMetrics("SmolLM2")
    m.request_prefill_time.observe(0.5)
    m.request_prompt_tokens.observe(600)
    m.request_prefill_kv_computed_tokens.observe(8)
    got = parse_engine_metrics(m.render().decode())
    assert (got["prefills"], got["prefill_seconds"]) == (1, 0.5)
    assert (got["prefill_prompt_tokens"], got["prefill_computed_tokens"]) == (600, 8)


async def test_scraper_sums_engines_and_counts_the_down_ones(unused_tcp_port) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=engine_text(100, 10, 50), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", unused_tcp_port)
    await site.start()
    try:
        up = f"http://127.0.0.1:{unused_tcp_port}"
        scraper = EngineScraper([up, up, "http://127.0.0.1:9"], timeout=1.0)
        got = await scraper.scrape()
        await scraper.close()
        assert got["prompt_tokens"] == 200 and got["store_hit_tokens"] == 100
        assert (got["engines_up"], got["engines"]) == (2, 3)
        assert got["by_url"]["http://127.0.0.1:9/metrics"] is None  # each engine's own fields, by URL
        assert got["by_url"][up + "/metrics"]["store_hit_tokens"] == 50
        assert await EngineScraper([]).scrape() is None
    finally:
        await runner.cleanup()


def test_sample_holds_latency_buckets_and_miss_reasons() -> None:
    metrics = ServerMetrics()
    for seconds in (0.0002, 0.003, 0.003):
        metrics.observe("get", 200, seconds, 0, 10)
    metrics.observe("batch_put", 201, 0.04, 10, 0)
    metrics.observe_reported("batch_get", 0.0004)  # a same-host client's own read (TOUCH): apart
    metrics.observe_reported("get", 0.0004)
    history = StatsHistory(3)
    stats = {"tiers": [{"name": "cpu", "hits": 2, "bytes": 5, "capacity": 10, "expired": 1}], "misses": 1,
             "miss_reasons": {"evicted": 1}}  # fmt: skip
    for _ in range(4):
        sample = history.add(stats, {"requests": 4, "errors": 0}, metrics.registry, {"prompt_tokens": 7.0})
    assert len(history.as_list()) == 3  # a ring buffer
    get = sample["latency"]["get"]
    assert len(get) == len(LATENCY_BUCKETS) and get[-1] == 3 and get[LATENCY_BUCKETS.index(0.00025)] == 1
    assert sample["latency"]["put"][-1] == 1 and sample["latency"]["lookup"][-1] == 0
    same_host = sample["latency"]["get (same host)"]
    assert same_host[-1] == 2 and same_host[LATENCY_BUCKETS.index(0.0005)] == 2
    assert sample["tiers"]["cpu"]["expired"] == 1 and sample["miss_reasons"] == {"evicted": 1.0}
    assert sample["engines"] == {"prompt_tokens": 7.0}


def test_history_route_names_the_bucket_bounds(server) -> None:
    body = server.request("GET", "/v1/stats/history").json()
    assert body["latency_buckets"] == LATENCY_BUCKETS[:-1]
