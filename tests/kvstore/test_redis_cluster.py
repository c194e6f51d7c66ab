"""The redis tier on a real 3-node Valkey Cluster: slots spread keys, batches span nodes, a dead node
costs only its own keys and comes back without recreating the tier."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from kvstore.config import StoreConfig
from kvstore.tiers import make_tier
from kvstore.tiers.base import TierWriteError
from kvstore.tiers.redis import RedisTier
from tests.kvstore.test_redis_tier import RoundTrips, command_calls
from tests.valkey import ValkeyCluster, wait_until


def key(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
def prefix() -> str:
    return f"c{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def tier(valkey_cluster: ValkeyCluster, prefix: str) -> Iterator[RedisTier]:
    t = RedisTier(valkey_cluster.urls, prefix=prefix, cluster=True)
    yield t
    t.close()


def test_keys_land_on_all_three_nodes(tier: RedisTier, valkey_cluster: ValkeyCluster, prefix: str) -> None:
    items = [(key(i), os.urandom(100 + i)) for i in range(60)]
    assert tier.put_many(items) == []
    per_node = Counter()
    for node in valkey_cluster.nodes:
        with node.client() as raw:
            per_node[node.port] = len(raw.keys(f"{prefix}*"))
    assert len(per_node) == 3 and all(n > 0 for n in per_node.values()), per_node
    assert sum(per_node.values()) == 60
    assert sorted(tier.keys()) == sorted(k for k, _ in items)
    assert tier.usage() == sum(len(b) for _, b in items) and len(tier) == 60


def test_single_and_batch_ops_across_nodes(tier: RedisTier) -> None:
    items = [(key(i), os.urandom(2000)) for i in range(12)]
    tier.put_many(items[:6])
    for k, b in items[6:]:
        tier.put(k, memoryview(b))
    wanted = [key(11), key(50), key(0), key(5), key(51)]
    assert tier.get_many(wanted) == [items[11][1], None, items[0][1], items[5][1], None]
    assert all(tier.get(k) == b for k, b in items)
    assert tier.contains(key(3)) and tier.delete(key(3)) and not tier.contains(key(3))
    assert tier.stats.errors == 0 and tier.stats.dropped_puts == 0


def test_contains_many_is_one_pipeline_per_primary(
    tier: RedisTier, valkey_cluster: ValkeyCluster, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [key(i) for i in range(30)]
    tier.put_many([(k, b"here") for i, k in enumerate(keys) if i != 13])  # a gap in the middle
    owners = {valkey_cluster.node_of(prefix + k).port for k in keys}
    assert len(owners) == 3
    round_trips = RoundTrips(monkeypatch)
    before = sum(command_calls(n, "exists") for n in valkey_cluster.nodes)
    sent_before = round_trips.count
    assert tier.contains_many(keys) == [i != 13 for i in range(30)]
    assert round_trips.count - sent_before == 3  # one pipeline per primary, asked concurrently
    assert sum(command_calls(n, "exists") for n in valkey_cluster.nodes) == before + 30
    assert tier.stats.errors == 0


def test_ttl_and_namespaces_in_the_cluster(
    valkey_cluster: ValkeyCluster, tier: RedisTier, prefix: str
) -> None:
    other = RedisTier(
        valkey_cluster.url, prefix=f"o{uuid.uuid4().hex[:8]}:", cluster=True
    )  # one startup node is enough
    try:
        tier.put_many([(key(i), b"mine") for i in range(6)], ttl_s=0.2)
        other.put(key(0), b"theirs")
        assert other.get(key(0)) == b"theirs" and tier.get(key(0)) == b"mine"
        assert list(other.keys()) == [key(0)] and len(list(tier.keys())) == 6
        wait_until(lambda: tier.get_many([key(i) for i in range(6)]) == [None] * 6, timeout=5)
        assert tier.stats.expired == 6 and tier.usage() == 0
        assert other.get(key(0)) == b"theirs"
    finally:
        other.delete(key(0))
        other.close()


def test_startup_nodes_skip_a_dead_one(valkey_cluster: ValkeyCluster, prefix: str) -> None:
    ports = ",".join(f"127.0.0.1:{n.port}" for n in valkey_cluster.nodes)
    t = RedisTier(f"redis://127.0.0.1:1,{ports}", prefix=prefix, cluster=True)
    t.put(key(1), b"x")
    assert t.get(key(1)) == b"x" and t.stats.errors == 0
    t.close()


def test_factory_builds_the_cluster_tier(valkey_cluster: ValkeyCluster, prefix: str) -> None:
    config = StoreConfig(
        tiers=["redis"], redis_url=valkey_cluster.urls, redis_prefix=prefix, redis_cluster=True
    )
    t = make_tier("redis", config)
    assert isinstance(t, RedisTier) and t.cluster
    t.put(key(1), b"via factory")
    assert t.get(key(1)) == b"via factory"
    t.close()


def test_one_node_down_costs_only_its_keys(
    valkey_cluster: ValkeyCluster, tier: RedisTier, prefix: str
) -> None:
    items = {key(i): os.urandom(500) for i in range(30)}
    tier.put_many(list(items.items()))
    victim = valkey_cluster.node_of(prefix + key(0))
    on_victim = {k for k in items if valkey_cluster.node_of(prefix + k) is victim}
    assert 0 < len(on_victim) < len(items)
    victim.kill()
    try:
        got = dict(zip(items, tier.get_many(list(items)), strict=True))
        for k, blob in items.items():
            assert got[k] == (None if k in on_victim else blob)
        assert all(tier.get(k) == (None if k in on_victim else b) for k, b in items.items())
        assert tier.contains_many(list(items)) == [k not in on_victim for k in items]
        dropped = tier.stats.dropped_puts
        with pytest.raises(TierWriteError) as e:  # the live nodes store theirs; the rest is named
            tier.put_many([(k, b"new") for k in items])
        assert set(e.value.failed) == on_victim and set(e.value.failed.values()) == {"unavailable"}
        assert not e.value.stale  # invalidated: the victim's old blobs are never served again
        assert tier.stats.dropped_puts == dropped + len(on_victim)
        assert tier.stats.errors >= 1
        assert set(tier.keys()) == set(items) - on_victim  # the live nodes still list theirs
    finally:
        victim.start()  # same port and nodes.conf: it rejoins with its slots, empty
        valkey_cluster.wait_ok()

    def healthy() -> bool:
        try:
            tier.put_many([(k, b"again") for k in on_victim])
        except TierWriteError:
            return False
        return tier.get_many(sorted(on_victim)) == [b"again"] * len(on_victim)

    wait_until(healthy)
    assert all(tier.get(k) == b"new" for k in set(items) - on_victim)


def test_cluster_tier_starts_while_no_node_answers(prefix: str) -> None:
    t = RedisTier("redis://127.0.0.1:1,127.0.0.1:2", prefix=prefix, cluster=True)  # nothing listens there
    assert t.get(key(1)) is None and t.get_many([key(1), key(2)]) == [None, None]
    with pytest.raises(TierWriteError) as e:
        t.put(key(1), b"x")
    assert e.value.failed == {key(1): "unavailable"}
    assert list(t.keys()) == [] and t.usage() == 0
    assert t.stats.dropped_puts == 1 and t.stats.errors >= 1
    t.close()
