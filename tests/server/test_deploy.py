"""deploy/: compose, Dockerfile, Prometheus rules and the Grafana dashboard parse, and every metric they
query is one that /metrics really exports (Docker cannot run here, so this is what can be checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvstore.config import StoreConfig
from kvstore.store import TieredStore
from sdk.remote import RemoteBackend
from server.cli import build_parser
from server.config import ServerConfig, load_configs
from server.runner import ServerThread
from tests.server.conftest import key, make_blob

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "and", "or", "without", "le"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Every sample name a server with all its series populated exports."""

    d = tmp_path_factory.mktemp("deploy")
    config = StoreConfig(tiers=["cpu", "disk"], disk_path=d / "disk")
    with ServerThread(TieredStore(config), config, ServerConfig(port=0), close_store=True) as srv:
        be = RemoteBackend(srv.url)
        be.put_blob(key(1), make_blob(1))
        be.get_blob(key(1))
        be.batch_get([key(1), key(2)])
        text = bytes(be.http.request("GET", "/metrics").body).decode()
        be.close()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(kvstore_[a-z_]+|up)\b(?=\s*[{\[)])", expr))
    return names - PROMQL_WORDS


def test_compose_file():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kvstore", "valkey"} <= set(services)
    kv = services["kvstore"]
    assert kv["build"]["dockerfile"] == "deploy/Dockerfile" and "valkey" in kv["depends_on"]
    assert kv["ports"] == ["127.0.0.1:8100:8100"]
    args = build_parser().parse_args(kv["command"])  # the flags the compose file passes really exist
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level") and v is not None}
    store, server = load_configs(**overrides)
    assert store.tiers == ["cpu", "disk", "redis"] and store.redis_url == "redis://valkey:6379/0"
    assert server.host == "0.0.0.0" and str(server.auth_token_file) == "/run/secrets/kvstore_token"
    assert "--save" in services["valkey"]["command"]
    assert compose["secrets"]["kvstore_token"]["file"] == "./secrets/kvstore_token"
    for svc in ("prometheus", "grafana"):
        for volume in services[svc]["volumes"]:
            assert (DEPLOY / volume.split(":")[0]).exists(), volume


def test_dockerfile_copies_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    root = DEPLOY.parent
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (root / src).exists(), src
    assert 'ENTRYPOINT ["python", "-m", "server"]' in text and "/healthz" in text


def test_alert_rules(exported):
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
        assert rule["expr"].count("(") == rule["expr"].count(")"), name
        for metric in metric_names(rule["expr"]) - {"up"}:
            assert metric in exported, f"{name} queries {metric}, which /metrics does not export"
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["metrics_path"] == "/metrics"
    assert prom["scrape_configs"][0]["authorization"]["type"] == "Bearer"  # /metrics is behind the token


def test_grafana_dashboard(exported):
    dash = json.loads((DEPLOY / "grafana" / "kvstore-dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    for wanted in (
        "Hit rate per tier",
        "Bytes per tier",
        "Evictions per second",
        "Request latency p50 / p99",
    ):
        assert any(t.startswith(wanted) for t in titles), wanted
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, target["expr"]
            for metric in names:
                assert metric in exported, f"panel {panel['title']!r} queries {metric}"
    for sub in ("datasources/prometheus.yml", "dashboards/kvstore.yml"):
        assert yaml.safe_load((DEPLOY / "grafana" / "provisioning" / sub).read_text())["apiVersion"] == 1

    assert "kvstore_request_seconds_bucket" in exported  # the latency panels' histogram
