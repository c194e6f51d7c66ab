"""RemoteBackend against real servers, on every transport: pooling, retries across a restart,
Unavailable, many threads."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvstore.sdk.remote import RemoteBackend
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread

from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.store import TieredStore
from tests.server.conftest import key, make_blob
from tests.valkey import free_port


def test_unreachable_server_is_unavailable_after_retries():
    port = free_port()
    be = RemoteBackend(f"http://127.0.0.1:{port}", retries=2, backoff=0.01, connect_timeout=1)
    start = time.monotonic()
    with pytest.raises(Unavailable):
        be.get_blob(key(1))
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("url", ["ftp://x", "127.0.0.1:8100", "http://"])
def test_bad_urls(url):
    with pytest.raises(InvalidArgument):
        RemoteBackend(url)


TRANSPORTS = ["http", "tcp", "shm"]


def _idle(be: RemoteBackend) -> int:
    return len(be.http.pool) if be.transport == "http" else len(be.plane.client.pool)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pooled_connections_survive_a_server_restart(tmp_path, transport):
    """A pooled keep-alive socket goes stale when the server restarts; the retry reconnects (and a
    shared-memory client maps the new server's segment)."""
    port = free_port()
    config = StoreConfig(tiers=["disk"], disk_path=tmp_path / "disk")
    be = RemoteBackend(f"http://127.0.0.1:{port}", retries=3, backoff=0.05, transport=transport)
    blob = make_blob(1, tokens=512, key=key(1))  # bound: the store keeps it as it is
    other = make_blob(1, tokens=512, key=key(2))
    with ServerThread(TieredStore(config), config, ServerConfig(port=port), close_store=True):
        be.put_blob(key(1), blob)
        assert be.transport == transport
        assert _idle(be) >= 1  # the connection went back to the pool
    with ServerThread(TieredStore(config), config, ServerConfig(port=port), close_store=True) as srv:
        assert bytes(be.get_blob(key(1))) == blob  # the disk tier kept it; the stale socket retried
        be.put_blob(key(2), other)
        assert bytes(be.get_blob(key(2))) == other and be.transport == transport
        if transport == "shm":
            assert srv.state.metrics.totals["requests"] and srv.server.plane.shm.used > 0
    be.close()


def test_retries_on_503_then_succeeds():
    """A server that answers 503 once (as a proxy in front of a restarting server would)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    busy = b'{"error": "warming up", "type": "Unavailable"}'
    ok = b'{"status": "ok"}'
    answers = [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(busy), busy),
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(ok), ok),
    ]
    seen = []

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                seen.append(conn.recv(65536))
                conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    be = RemoteBackend(f"http://127.0.0.1:{port}", retries=2, backoff=0.01)
    assert be.http.request("GET", "/healthz").json() == {"status": "ok"}
    t.join(5)
    listener.close()
    assert len(seen) == 2 and all(s.startswith(b"GET /healthz HTTP/1.1") for s in seen)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_threads_share_one_backend(server, transport):
    be = RemoteBackend(server.url, pool_size=4, transport=transport)

    def work(i: int) -> bool:
        blob = make_blob(i, key=key(i))
        be.put_blob(key(i), blob)
        ok = bytes(be.get_blob(key(i))) == blob
        got = be.batch_get([key(i), key(10_000 + i)])
        return ok and bytes(got[0]) == blob and got[1] is None and be.exists(key(i))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(64)))
    assert server.usage()[0] == 64
    assert _idle(be) <= 4
    be.close()
    with pytest.raises(InvalidArgument):
        be.get_blob(key(1))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_batches_roundtrip(server, transport):
    be = RemoteBackend(server.url, transport=transport)
    items = [(key(i), make_blob(i, tokens=2048, key=key(i))) for i in range(8)]  # 8 x 128 KiB
    be.batch_put(items)
    got = be.batch_get([k for k, _ in items])
    assert [bytes(g) for g in got] == [b for _, b in items]
    be.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_calls_from_successive_event_loops(server, transport):
    import asyncio

    be = RemoteBackend(server.url, transport=transport)
    asyncio.run(be.aput_blob(key(1), make_blob(1, key=key(1))))
    assert asyncio.run(be.aexists(key(1)))  # a new loop: the session of the first one is not reused
    assert bytes(asyncio.run(be.aget_blob(key(1)))) == make_blob(1, key=key(1))
    asyncio.run(be.aclose())
