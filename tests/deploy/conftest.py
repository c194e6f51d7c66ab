"""What deploy/ may query: every sample name kvstore-server and kvstore-engine really export."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvstore.connectors.metrics import ConnectorMetrics
from kvstore.engine.metrics import EngineMetrics
from kvstore.sdk.remote import RemoteBackend
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread
from prometheus_client.parser import text_string_to_metric_families

from kvstore.config import StoreConfig
from kvstore.store import TieredStore
from tests.server.conftest import key, make_blob

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="session")
def server_metrics(tmp_path_factory) -> set[str]:
    """A live server with every series populated (reads, misses, batches, lookups)."""
    d = tmp_path_factory.mktemp("deploy")
    config = StoreConfig(tiers=["cpu", "disk"], disk_path=d / "disk")
    with ServerThread(TieredStore(config), config, ServerConfig(port=0), close_store=True) as srv:
        be = RemoteBackend(srv.url)
        be.put_blob(key(1), make_blob(1))
        be.get_blob(key(1))
        be.batch_get([key(1), key(2)])
        be.lookup([key(1), key(3)])
        text = bytes(be.http.request("GET", "/metrics").body).decode()
        be.close()
    return sample_names(text)


@pytest.fixture(scope="session")
def engine_metrics() -> set[str]:
    """The engine's /metrics text as LLMEngine.render_metrics builds it: engine, then connector."""
    metrics = EngineMetrics("SmolLM2-135M-Instruct")
    connector = ConnectorMetrics()
    connector.record_lookup(10, 5, preempted=False)
    return sample_names((metrics.render() + connector.render("SmolLM2-135M-Instruct")).decode())
