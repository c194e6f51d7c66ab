"""RemoteBackend against real servers: pooling, retries across a restart, Unavailable, many threads."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.store import TieredStore
from sdk.remote import RemoteBackend
from server.config import ServerConfig
from server.runner import ServerThread
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


def test_pooled_connections_survive_a_server_restart(tmp_path):
    """A pooled keep-alive socket goes stale when the server restarts; the retry reconnects."""
    port = free_port()
    config = StoreConfig(tiers=["disk"], disk_path=tmp_path / "disk")
    be = RemoteBackend(f"http://127.0.0.1:{port}", retries=3, backoff=0.05)
    with ServerThread(TieredStore(config), config, ServerConfig(port=port), close_store=True):
        be.put_blob(key(1), make_blob(1))
        assert len(be._idle) == 1  # the connection went back to the pool
    with ServerThread(TieredStore(config), config, ServerConfig(port=port), close_store=True):
        assert bytes(be.get_blob(key(1))) == make_blob(1)  # the disk tier kept it; the stale socket retried
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
    assert be.request("GET", "/healthz").json() == {"status": "ok"}
    t.join(5)
    listener.close()
    assert len(seen) == 2 and all(s.startswith(b"GET /healthz HTTP/1.1") for s in seen)


def test_many_threads_share_one_backend(server):
    be = RemoteBackend(server.url, pool_size=4)

    def work(i: int) -> bool:
        blob = make_blob(i)
        be.put_blob(key(i), blob)
        ok = bytes(be.get_blob(key(i))) == blob
        got = be.batch_get([key(i), key(10_000 + i)])
        return ok and bytes(got[0]) == blob and got[1] is None and be.exists(key(i))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(64)))
    assert server.usage()[0] == 64
    assert len(be._idle) <= 4
    be.close()
    with pytest.raises(InvalidArgument):
        be.get_blob(key(1))


def test_large_batches_roundtrip(server):
    be = RemoteBackend(server.url)
    items = [(key(i), make_blob(i, tokens=2048)) for i in range(8)]  # 8 x 128 KiB
    be.batch_put(items)
    got = be.batch_get([k for k, _ in items])
    assert [bytes(g) for g in got] == [b for _, b in items]
    be.close()


def test_pooled_receive_buffers_never_overwrite_a_held_blob(server):
    be = RemoteBackend(server.url)
    a, b = make_blob(1, tokens=2048), make_blob(2, tokens=2048)  # 128 KiB: pooled sizes
    be.batch_put([(key(1), a), (key(2), b)])
    held = be.get_blob(key(1))
    held_slice = be.batch_get([key(1)])[0]  # a slice of a pooled frame buffer
    for _ in range(5):
        assert bytes(be.get_blob(key(2))) == b
        assert bytes(be.batch_get([key(2)])[0]) == b
    assert bytes(held) == a and bytes(held_slice) == a
    pooled = be._buffers._buffers
    assert len(pooled) <= 4  # the two held, plus the ones released and reused across 10 responses
    again = be.get_blob(key(1))
    assert any(again.obj is buf for buf in pooled)  # a reused buffer: no fresh allocation per response
    assert bytes(again) == a
    be.close()


def test_async_calls_from_successive_event_loops(server):
    import asyncio

    be = RemoteBackend(server.url)
    asyncio.run(be.aput_blob(key(1), make_blob(1)))
    assert asyncio.run(be.aexists(key(1)))  # a new loop: the session of the first one is not reused
    assert bytes(asyncio.run(be.aget_blob(key(1)))) == make_blob(1)
    asyncio.run(be.aclose())
