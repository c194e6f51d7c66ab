"""Grafana dashboards and Prometheus rules: every query parses as PromQL (promql-parser, the
GreptimeDB/Prometheus grammar) and names only metrics that kvstore-server or kvstore-engine export."""

from __future__ import annotations

import json

import promql_parser
import pytest
import yaml

from tests.deploy.conftest import DEPLOY

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$instance": ".*", "$model_name": ".*"}


def selectors(expr: str) -> set[str]:
    """The metric names an expression reads, from its parsed AST (a syntax error fails here)."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_the_checker_catches_bad_queries() -> None:
    assert selectors('sum by (tier) (rate(kvstore_hits_total{instance=~"$instance"}[$__rate_interval]))') == {
        "kvstore_hits_total"
    }
    with pytest.raises(ValueError):
        selectors("sum(rate(kvstore_hits_total[5m])")


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


@pytest.mark.parametrize(
    ("board", "wanted"),
    [
        ("kvstore-dashboard.json", ["Prompt tokens not recomputed", "Where prompt tokens came from",
                                    "Prefill time saved", "Why reads missed", "Hit rate per tier",
                                    "Request latency p50 / p99", "Bytes per tier", "Evictions per second"]),
        ("engine-dashboard.json", ["Time to first token", "Inter-token latency", "End-to-end request latency",
                                   "Requests running / waiting", "KV cache usage", "Prefix cache hit rate",
                                   "Preemptions per second", "Chunk misses by reason"]),
    ],
)  # fmt: skip
def test_dashboards_query_only_exported_metrics(board, wanted, server_metrics, engine_metrics) -> None:
    dash = json.loads((DEPLOY / "grafana" / board).read_text())
    titles = [p["title"] for p in panels(dash)]
    for title in wanted:
        assert any(t.startswith(title) for t in titles), title
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exported = server_metrics | engine_metrics
    for panel in panels(dash):
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = selectors(target["expr"])
            assert names, target["expr"]
            missing = names - exported
            assert not missing, f"panel {panel['title']!r} queries {missing}, which nothing exports"
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            assert selectors(var["query"]["query"].removeprefix("label_values(").split(",")[0]) <= exported


def test_engine_dashboard_uses_the_model_name_label(engine_metrics) -> None:
    dash = json.loads((DEPLOY / "grafana" / "engine-dashboard.json").read_text())
    for panel in panels(dash):
        for target in panel["targets"]:
            assert 'model_name=~"$model_name"' in target["expr"], panel["title"]
    # ... which the connector's metrics carry too, not only the engine's own
    assert "kvstore_connector_chunk_misses_total" in engine_metrics


def test_alert_rules(server_metrics) -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {
        "KVStoreLowHitRate",
        "KVStoreHighErrorRate",
        "KVStoreCapacityNearFull",
        "KVStoreCorruptBlobs",
    } <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert rule["annotations"]["summary"], name
        missing = selectors(rule["expr"]) - server_metrics - {"up"}
        assert not missing, f"{name} queries {missing}, which /metrics does not export"


def test_prometheus_scrapes_the_server_and_the_engine() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    assert jobs["kvstore"]["authorization"]["type"] == "Bearer"  # the server's /metrics is behind the token
    assert jobs["kvstore-engine"]["static_configs"][0]["targets"] == ["engine:8000"]
    for sub in ("datasources/prometheus.yml", "dashboards/kvstore.yml"):
        assert yaml.safe_load((DEPLOY / "grafana" / "provisioning" / sub).read_text())["apiVersion"] == 1


def test_read_rates_count_lookups_cut_short_and_saved_time_counts_compute_only() -> None:
    """Issue 30 #15, as on /dashboard: a read rate's misses include the prefix lookups a missing key
    cut short, and the saved prefill time takes its cost per token from minutes the store served nothing
    to (not from prefills that also loaded KV, which counted the load as compute)."""
    dash = json.loads((DEPLOY / "grafana" / "kvstore-dashboard.json").read_text())
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels(dash)}
    reads = next(e for e in exprs["Hit rate over time"] if "kvstore_misses_total" in e)
    assert "kvstore_prefix_lookups_total" in selectors(reads) and 'result="cut_short"' in reads
    (saved,) = exprs["Prefill time saved by the store (est.)"]
    assert "== 0)" in saved and ":1m])" in saved  # per-minute steps in which the store provided no token
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    low = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "KVStoreLowHitRate")
    assert "kvstore_prefix_lookups_total" in selectors(low["expr"])
