"""/metrics: valid Prometheus text with the store's series and the server's own request metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvstore.protocol import wire
from tests.server.conftest import key, make_blob


def scrape(srv) -> dict[str, list]:
    r = srv.request("GET", "/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f.samples for f in text_string_to_metric_families(r.body.decode())}
    assert families, "no metric families parsed"
    return families


def value(families, name: str, **labels: str) -> float:
    for family in families.values():
        for s in family:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name}{labels} not in /metrics")


def test_metrics_parse_and_count(server):
    blob = make_blob(1)
    server.request("PUT", wire.chunk_path(key(1)), blob)
    for _ in range(3):
        server.request("GET", wire.chunk_path(key(1)))
    server.request("GET", wire.chunk_path(key(2)))  # a miss: 404
    server.request("GET", wire.chunk_path("bad"))  # 400
    server.request("GET", "/nope")  # unmatched route
    server.request("HEAD", wire.chunk_path(key(1)))
    f = scrape(server)
    assert value(f, "kvstore_http_requests_total", op="head", status="200") == 1  # not served as a get
    # the server's own series
    assert value(f, "kvstore_request_seconds_count", op="get") == 5
    assert value(f, "kvstore_request_seconds_count", op="put") == 1
    assert value(f, "kvstore_http_requests_total", op="get", status="200") == 3
    assert value(f, "kvstore_http_requests_total", op="get", status="404") == 1
    assert value(f, "kvstore_http_requests_total", op="get", status="400") == 1
    assert value(f, "kvstore_http_requests_total", op="unmatched", status="404") == 1
    assert value(f, "kvstore_http_received_bytes_total", op="put") == len(blob)
    assert value(f, "kvstore_http_sent_bytes_total", op="get") == 3 * len(blob)
    # the store's series, from its own registry
    assert value(f, "kvstore_hits_total", tier="cpu") == 3
    assert value(f, "kvstore_misses_total") == 1
    assert value(f, "kvstore_bytes", tier="cpu") == len(blob)
    assert value(f, "kvstore_keys", tier="cpu") == 1
    assert value(f, "kvstore_capacity_bytes", tier="cpu") == 64 * 2**20
    # histogram buckets are cumulative and end at +Inf == count
    assert value(f, "kvstore_request_seconds_bucket", op="get", le="+Inf") == 5


def test_metrics_names_are_unique(server):
    r = server.request("GET", "/metrics").body.decode()
    helps = [line.split()[2] for line in r.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps)), "the store's and the server's registries define a name twice"
