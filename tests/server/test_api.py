"""API conformance: every endpoint of kvstore-server, spoken as raw HTTP/1.1."""

from __future__ import annotations

import json

from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob, wait_for


def _put_frame(items: list[tuple[str, bytes]]) -> bytes:
    return b"".join(bytes(p) for p in wire.encode_frame([k for k, _ in items], [b for _, b in items]))


def _keys(*keys: str) -> bytes:
    return json.dumps({"keys": list(keys)}).encode()


def test_single_chunk_put_get_head_delete(server):
    blob = make_blob(1)
    r = server.request("PUT", wire.chunk_path(key(1)), blob)
    assert r.status == 201
    r = server.request("GET", wire.chunk_path(key(1)))
    assert r.status == 200 and r.body == kept(blob, key(1))  # a blob bound to no key: kept bound to key(1)
    assert r.headers["content-type"] == wire.BLOB_CONTENT_TYPE
    assert r.headers[wire.WIRE_VERSION_HEADER.lower()] == wire.WIRE_VERSION
    assert server.request("HEAD", wire.chunk_path(key(1))).status == 200
    assert server.request("HEAD", wire.chunk_path(key(2))).status == 404
    assert server.request("DELETE", wire.chunk_path(key(1))).status == 204
    r = server.request("DELETE", wire.chunk_path(key(1)))
    assert r.status == 404 and r.json()["type"] == "NotFound"
    r = server.request("GET", wire.chunk_path(key(1)))
    assert r.status == 404 and r.json() == {
        "error": f"no chunk {key(1)}",
        "type": "NotFound",
        "reason": "not_stored",
    }
    assert r.headers[wire.MISS_REASON_HEADER.lower()] == "not_stored"  # deleted: as if never stored
    assert server.usage() == (0, 0)


def test_large_blob_streams_back_intact(server):
    blob = make_blob(2, tokens=2048, key=key(2))  # 256 KiB: takes the headers-then-buffers path
    assert len(blob) > 64 * 1024
    assert server.request("PUT", wire.chunk_path(key(2)), blob).status == 201
    r = server.request("GET", wire.chunk_path(key(2)))
    assert r.status == 200 and int(r.headers["content-length"]) == len(blob) and r.body == blob


def test_put_replaces(server):
    server.request("PUT", wire.chunk_path(key(3)), make_blob(3))
    server.request("PUT", wire.chunk_path(key(3)), make_blob(4))
    assert server.request("GET", wire.chunk_path(key(3))).body == kept(make_blob(4), key(3))
    assert server.usage() == (1, len(make_blob(4)))


def test_batch_put_get_exists_delete(server):
    items = [(key(i), make_blob(i, tokens=8 + 8 * i)) for i in range(4)]
    r = server.request(
        "POST", wire.BATCH_PUT_PATH, _put_frame(items), {"Content-Type": wire.BATCH_CONTENT_TYPE}
    )
    assert r.status == 201 and r.json() == {"stored": 4, "stored_in": [["cpu"]] * 4}
    r = server.request("POST", wire.BATCH_GET_PATH, _keys(key(2), key(99), key(0)))
    assert r.status == 200 and r.headers["content-type"] == wire.BATCH_CONTENT_TYPE
    keys, blobs = wire.decode_frame(r.body, allow_missing=True)
    assert keys == [key(2), key(99), key(0)]
    assert [None if b is None else bytes(b) for b in blobs] == [
        kept(items[2][1], key(2)),
        None,
        kept(items[0][1], key(0)),
    ]
    r = server.request("POST", wire.BATCH_EXISTS_PATH, _keys(key(0), key(99), key(3)))
    assert r.json() == {"exists": [True, False, True]}
    r = server.request("POST", wire.BATCH_DELETE_PATH, _keys(key(0), key(99)))
    assert r.json() == {"deleted": 1}
    assert server.usage()[0] == 3


def test_empty_batches(server):
    r = server.request("POST", wire.BATCH_GET_PATH, _keys())
    assert r.status == 200 and wire.decode_frame(r.body) == ([], [])
    assert server.request("POST", wire.BATCH_PUT_PATH, _put_frame([])).json() == {
        "stored": 0,
        "stored_in": [],
    }
    assert server.request("POST", wire.LOOKUP_PATH, _keys()).json() == {"prefix": 0, "keys": 0, "miss": None}


def test_lookup_returns_longest_present_prefix(server):
    for i in (0, 1, 2, 4):
        server.request("PUT", wire.chunk_path(key(i)), make_blob(i))
    r = server.request("POST", wire.LOOKUP_PATH, _keys(*(key(i) for i in range(6))))
    assert r.status == 200 and r.json() == {"prefix": 3, "keys": 6, "miss": "not_stored"}  # key(3): first gap
    assert server.request("POST", wire.LOOKUP_PATH, _keys(key(9), key(0))).json()["prefix"] == 0


def test_stats_health_history_dashboard(server):
    server.request("PUT", wire.chunk_path(key(1)), make_blob(1))
    server.request("GET", wire.chunk_path(key(1)))
    server.request("GET", wire.chunk_path(key(2)))
    r = server.request("GET", "/healthz")
    assert r.status == 200 and r.json() == {"status": "ok"}
    stats = server.request("GET", wire.STATS_PATH).json()
    cpu = stats["tiers"][0]
    assert cpu["name"] == "cpu" and cpu["keys"] == 1 and cpu["hits"] == 1 and stats["misses"] == 1
    assert stats["server"]["requests"] >= 3

    def sampled() -> dict:  # the sampler runs every 0.2 s in tests: two samples, the last after the gets
        return server.request("GET", wire.HISTORY_PATH).json()

    wait_for(lambda: len((h := sampled())["samples"]) >= 2 and h["samples"][-1]["tiers"]["cpu"]["hits"] == 1)
    hist = sampled()
    assert hist["interval"] == 0.2 and len(hist["samples"]) >= 2
    last = hist["samples"][-1]
    assert last["tiers"]["cpu"]["hits"] == 1 and last["tiers"]["cpu"]["bytes"] == len(make_blob(1))
    assert last["requests"] >= 3
    since = server.request("GET", f"{wire.HISTORY_PATH}?since={last['t']}").json()["samples"]
    assert all(s["t"] > last["t"] for s in since)
    assert server.request("GET", f"{wire.HISTORY_PATH}?since=yesterday").status == 400
    r = server.request("GET", "/dashboard")
    assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    assert (
        b"<svg" in r.body
        and b"/v1/stats/history" in r.body
        and b"http://" not in r.body.replace(b"http://www.w3.org/2000/svg", b"")
    )  # self-contained: no CDN
    r = server.request("GET", "/")
    assert r.status == 302 and r.headers["location"] == "/dashboard"
