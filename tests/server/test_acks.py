"""A 201 says what was stored: on a full disk (a real 4 MiB tmpfs) the server answers 507 naming the
tier and errno, never a 201 for a blob it lost; a 201 names the tiers in X-KVStore-Stored-In, a batch
names them per key; /metrics counts only the bytes written and the dropped writes by reason."""

from __future__ import annotations

import json
import re

import pytest
from kvstore.sdk import Store

from kvstore.errors import NotStored
from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob
from tests.valkey import wait_until

MiB = 2**20


def big(i: int) -> bytes:
    return make_blob(i, tokens=MiB // 128)  # [2, 2, T, 2, 8] fp16: 128 B per token -> 1 MiB + 60 B


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


@pytest.fixture
def disk_only(server_factory, tmpfs):
    return server_factory(store={"tiers": ["disk"], "disk_path": tmpfs, "disk_capacity": "64MiB"})


def test_a_full_disk_is_a_507_never_a_201(disk_only):
    acked, refused = [], []
    for i in range(10):
        r = disk_only.request("PUT", wire.chunk_path(key(i)), big(i))
        if r.status == 201:
            assert r.headers[wire.STORED_IN_HEADER.lower()] == "disk"
            acked.append(i)
        else:
            assert r.status == 507, (r.status, r.body)
            body = r.json()
            assert body["type"] == "NotStored" and "disk" in body["error"] and "ENOSPC" in body["error"]
            refused.append(i)
    assert len(acked) == 3 and len(refused) == 7
    for i in acked:  # every acknowledged blob reads back, byte for byte
        assert disk_only.request("GET", wire.chunk_path(key(i))).body == kept(big(i), key(i))
    for i in refused:
        assert disk_only.request("GET", wire.chunk_path(key(i))).status == 404
    metrics = disk_only.request("GET", "/metrics").body.decode()
    assert _metric(metrics, "kvstore_written_bytes_total", tier="disk") == 3 * len(big(0))
    assert _metric(metrics, "kvstore_dropped_writes_total", tier="disk", reason="no_space") == 7


def test_a_batch_names_the_tiers_of_each_blob(disk_only):
    blobs = [big(0), big(1), make_blob(2), big(3), big(4)]  # the 4th and 5th 1 MiB blobs do not fit
    body = b"".join(wire.encode_frame([key(i) for i in range(5)], blobs))
    r = disk_only.request("POST", wire.BATCH_PUT_PATH, body)
    assert r.status == 507 and r.json()["type"] == "NotStored", r.body
    assert r.json()["stored_in"] == [["disk"], ["disk"], ["disk"], ["disk"], []]
    got = disk_only.request("POST", wire.BATCH_GET_PATH, json.dumps({"keys": [key(3), key(4)]}).encode())
    _, payloads = wire.decode_frame(got.body, allow_missing=True)
    assert bytes(payloads[0]) == kept(big(3), key(3)) and payloads[1] is None


def test_the_sdk_raises_a_typed_error_and_returns_the_tiers(server_factory, tmpfs):
    srv = server_factory(store={"tiers": ["cpu", "disk"], "disk_path": tmpfs, "disk_capacity": "64MiB"})
    with Store.connect(srv.url) as store:
        assert [store.put(key(i), big(i)) for i in range(5)] == [["cpu", "disk"]] * 3 + [["cpu"]] * 2
        assert store.batch_put([(key(9), big(9))]) == [["cpu"]]  # the disk is full
    only_disk = server_factory(store={"tiers": ["disk"], "disk_path": tmpfs / "x", "disk_capacity": "64MiB"})
    with Store.connect(only_disk.url) as store, pytest.raises(NotStored) as e:
        store.put(key(20), big(20))
    assert e.value.status == 507 and "ENOSPC" in str(e.value)


def test_deletes_through_a_redis_outage_over_http(server_factory, valkey_factory):
    """204 for a delete Redis will get on its return (never the old blob meanwhile); 503 naming redis
    once it cannot remember more."""
    valkey = valkey_factory("--appendonly", "yes", "--appendfsync", "always")  # data survives SIGKILL
    srv = server_factory(store={"tiers": ["cpu", "redis"], "redis_url": valkey.url, "redis_prefix": "h:",
                                "redis_max_invalidated": 1})  # fmt: skip
    for i in range(3):
        r = srv.request("PUT", wire.chunk_path(key(i)), make_blob(i))
        assert r.status == 201 and r.headers[wire.STORED_IN_HEADER.lower()] == "cpu,redis"
    valkey.kill()
    assert srv.request("DELETE", wire.chunk_path(key(0))).status == 204
    r = srv.request("DELETE", wire.chunk_path(key(1)))
    assert r.status == 503 and r.json()["type"] == "Unavailable" and "redis" in r.json()["error"]
    r = srv.request("PUT", wire.chunk_path(key(2)), make_blob(9))  # a replace redis cannot take either
    assert r.status == 503 and "redis" in r.json()["error"]
    valkey.start()
    for _ in range(10):
        assert srv.request("GET", wire.chunk_path(key(0))).status == 404
    wait_until(lambda: srv.request("DELETE", wire.chunk_path(key(1))).status == 204)  # replayed: room
