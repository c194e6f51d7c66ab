"""The server reports why each miss missed (lookup, batch get, single GET), and the SDK hands the
reasons on, in both modes: so a connector can tell an evicted chunk from an expired one."""

from __future__ import annotations

import pytest
from kvstore.sdk import Store
from kvstore.sdk.local import LocalBackend

from kvstore.clock import ManualClock
from kvstore.protocol import wire
from tests.server.conftest import key, make_blob


@pytest.mark.parametrize("mode", ["remote", "local"])
async def test_reasons_reach_the_client(server_factory, mode) -> None:
    size = len(make_blob(0))
    clock = ManualClock()
    srv = server_factory({"cpu_capacity": 2 * size, "ttl": 0.4}, clock=clock)
    store = Store.connect(srv.url) if mode == "remote" else None
    local = srv.store
    try:
        client = store if store is not None else Store(LocalBackend(local))  # the server's own store
        for i in range(3):  # room for two: key 0 is evicted
            client.put(key(i), make_blob(i))
        assert client.lookup([key(1), key(2), key(3)]) == (2, "not_stored")
        assert client.lookup([key(0), key(1)]) == (0, "evicted")
        assert client.lookup([key(1)]) == (1, None)
        reasons: list[str | None] = []
        blobs = client.batch_get_blobs([key(0), key(1), key(5)], reasons)
        assert blobs[1] is not None and reasons == ["evicted", None, "not_stored"]
        clock.advance(0.5)  # past the TTL
        assert client.lookup([key(1)]) == (0, "expired")
        assert await client.alookup([key(2), key(1)]) == (0, "expired")
        assert local.stats()["miss_reasons"]["expired"] == 2
    finally:
        if store is not None:
            store.close()


def test_a_get_404_names_its_reason(server_factory) -> None:
    srv = server_factory({"cpu_capacity": len(make_blob(0))})
    srv.request("PUT", wire.chunk_path(key(1)), make_blob(1))
    srv.request("PUT", wire.chunk_path(key(2)), make_blob(2))
    r = srv.request("GET", wire.chunk_path(key(1)))
    assert r.status == 404 and r.json()["reason"] == "evicted"
    assert r.headers[wire.MISS_REASON_HEADER.lower()] == "evicted"
    text = srv.request("GET", "/metrics").body.decode()
    assert 'kvstore_miss_reasons_total{reason="evicted"} 1.0' in text
