"""The server's poll for a same-host client's next request (kvstore.server.idle_poll): it watches exactly the
same-host data-plane connections, forgets them when they close, returns as soon as one has a request
waiting, gives up after `poll_us`, and is off with 0."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from kvstore.sdk.remote import RemoteBackend
from kvstore.server.idle_poll import IdlePoll

from tests.sdk.test_transports import wait_for
from tests.server.conftest import key, make_blob
from tests.server.test_dataplane import Raw


def watched(poll: IdlePoll) -> set[int]:
    """The descriptors the poll's epoll watches, from the kernel's own list."""
    assert poll._epoll is not None
    info = Path(f"/proc/self/fdinfo/{poll._epoll.fileno()}").read_text()
    return {int(line.split()[1]) for line in info.splitlines() if line.startswith("tfd:")}


def test_same_host_connections_are_watched_until_they_close(server):
    poll = server.thread.server.plane.idle_poll
    assert poll.poll_s == 200e-6 and watched(poll) == set()
    shm_client = RemoteBackend(server.url)  # over the Unix socket
    tcp_client = RemoteBackend(server.url, transport="tcp")  # loopback TCP: this host too
    raw = Raw(server.port)
    for be in (shm_client, tcp_client):
        be.put_blob(key(1), make_blob(1, key=key(1)))
        assert bytes(be.get_blob(key(1))) == make_blob(1, key=key(1))
    conns = server.thread.server.plane.connections
    sockets = lambda: {c.transport.get_extra_info("socket").fileno() for c in list(conns)}  # noqa: E731
    wait_for(lambda: watched(poll) == sockets())  # HELLO's first socket closing
    assert all(c._polled for c in list(conns)) and len(sockets()) == len(conns) >= 3
    shm_client.close()
    tcp_client.close()
    raw.sock.close()
    wait_for(lambda: not server.thread.server.plane.connections)
    # asyncio closes a socket just after connection_lost: epoll drops it then, a moment later
    wait_for(lambda: watched(poll) == set())


def test_poll_us_0_watches_nothing(server_factory):
    srv = server_factory(poll_us=0)
    be = RemoteBackend(srv.url)
    be.put_blob(key(2), make_blob(2, key=key(2)))
    assert bytes(be.get_blob(key(2))) == make_blob(2, key=key(2))
    plane = srv.thread.server.plane
    assert plane.idle_poll._epoll is None and not any(c._polled for c in plane.connections)
    be.close()


def test_the_poll_returns_when_a_request_waits_and_gives_up_after_its_bound():
    a, b = socket.socketpair()
    poll = IdlePoll(0.05)
    assert poll.add(a.fileno())

    async def one_poll() -> float:
        t0 = time.perf_counter()
        poll.after_reply()
        poll.after_reply()  # once per loop iteration, however many replies
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return time.perf_counter() - t0

    idle = asyncio.run(one_poll())
    assert 0.05 <= idle < 0.5, idle
    b.sendall(b"next request")
    ready = asyncio.run(one_poll())
    assert ready < 0.02, ready
    poll.close()
    assert not IdlePoll(0).add(a.fileno())
    a.close()
    b.close()
