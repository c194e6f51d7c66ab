"""The SDK's transports against a real server: shared memory and the TCP data plane move the same
bytes as HTTP, obey the same auth and limits, and fall back when the faster path is not there."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import pytest
import torch
from kvstore.sdk import dataplane as sdp
from kvstore.sdk.remote import RemoteBackend
from kvstore.sdk.store import Store

from kvstore.blob import verify_blob
from kvstore.errors import CorruptBlob, InvalidArgument, InvalidKey, TooLarge, Unauthorized, Unavailable
from kvstore.protocol import shm
from tests.server.conftest import key, make_blob, wait_for

TOKEN = "t0ken"
pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")


def memfds() -> int:
    """File descriptors of shared-memory segments open in this process (the in-process test servers
    hold theirs here; each mmap of a segment holds one too)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-shm")
        except OSError:
            pass
    return n


@pytest.mark.parametrize("transport", ["shm", "tcp", "http"])
def test_round_trips_are_bit_exact(server, transport):
    be = RemoteBackend(server.url, transport=transport)
    assert be.transport == transport
    sizes = [1, 64, 512, 2048, 8192]  # 180 B-1 MiB
    blobs = {key(i): make_blob(i, tokens=t, key=key(i)) for i, t in enumerate(sizes)}  # kept as they are
    for k, b in blobs.items():
        be.put_blob(k, b)
    for k, b in blobs.items():
        got = be.get_blob(k)
        assert bytes(got) == b
        verify_blob(got)
    ks = [*blobs, key(99)]
    assert [None if g is None else bytes(g) for g in be.batch_get(ks)] == [*blobs.values(), None]
    with be.lease(ks) as lease:
        assert [None if g is None else bytes(g) for g in lease] == [*blobs.values(), None]
    again = {key(100 + i): make_blob(i, tokens=t, key=key(100 + i)) for i, t in enumerate(sizes)}
    be.batch_put(list(again.items()))
    assert [bytes(b) for b in be.batch_get(list(again))] == list(again.values())
    assert be.batch_exists([key(0), key(99)]) == [True, False] and be.lookup_prefix(ks) == 5
    assert be.delete(key(0)) and not be.delete(key(0)) and be.get_blob(key(0)) is None
    if transport == "shm":
        assert be.counts["shm"] > 0
    be.close()


def test_store_tensors_over_shared_memory(server):
    with Store.connect(server.url, transport="shm") as store:
        kv = torch.randn(2, 4, 256, 8, 64).half()  # 4 MiB
        store.put(key(1), kv)
        out = torch.empty_like(kv)
        assert torch.equal(store.get(key(1)), kv) and torch.equal(store.get(key(1), out=out), kv)
        assert [torch.equal(t, kv) for t in store.batch_get([key(1), key(1)])] == [True, True]
        # the put through the segment; the gets in place in the arena, without a request
        assert store.backend.counts["shm"] == 1 and store.backend.counts["in_place"] == 3


def test_a_released_lease_is_reused_and_its_views_are_dead(server):
    be = RemoteBackend(server.url, transport="shm")
    a, b = make_blob(1, tokens=4096, key=key(1)), make_blob(2, tokens=4096, key=key(2))
    be.batch_put([(key(1), a), (key(2), b)])
    owned = be.get_blob(key(1))
    lease = be.lease([key(1)])
    view = lease.blobs[0]
    assert bytes(view) == a
    lease.release()
    with pytest.raises(ValueError):
        bytes(view)  # released with its lease: a stale use fails loudly instead of reading new data
    for _ in range(3):
        with be.lease([key(2)]) as again:
            assert bytes(again[0]) == b
    assert bytes(owned) == a  # a get_blob buffer belongs to the caller: never overwritten
    be.close()


def test_an_exported_view_keeps_its_region_out_of_reuse(server):
    be = RemoteBackend(server.url, transport="shm")
    a, b = make_blob(1, tokens=4096, key=key(1)), make_blob(2, tokens=4096, key=key(2))
    be.batch_put([(key(1), a), (key(2), b)])
    lease = be.lease([key(1)])
    held = pickle.PickleBuffer(lease.blobs[0])  # holds an export of the lent view, as C extensions do
    lease.release()  # the region cannot be reused while `held` reads it
    for _ in range(4):
        with be.lease([key(2)]) as other:
            assert bytes(other[0]) == b
    assert bytes(held) == a
    held.release()
    with be.lease([key(1)]) as again:
        assert bytes(again[0]) == a
    be.close()


def test_a_full_segment_falls_back_to_the_socket(server_factory):
    srv = server_factory(store={"tiers": ["disk"]})  # blobs outside the cpu arena: copied, not lent
    be = RemoteBackend(srv.url, transport="shm", shm_size=4 * 2**20)
    blob = make_blob(1, tokens=16384, key=key(1))  # 2 MiB: one fits in a 4 MiB segment
    be.put_blob(key(1), blob)
    leases = [be.lease([key(1)]) for _ in range(4)]
    assert all(bytes(lease[0]) == blob for lease in leases)
    assert be.counts["shm"] == 2 and be.counts["tcp"] == 3  # the put and one lease; the rest: socket
    for lease in leases:
        lease.release()
    be.close()


def test_hits_in_the_cpu_arena_are_lent_where_they_lie(server):
    """A shared-memory get of cpu-tier blobs moves no bytes: the server lends them in its arena (mapped
    read-only here), however full the client's own segment is, and takes them back with the lease."""
    arena = server.store.tiers[0].arena
    assert arena is not None
    be = RemoteBackend(server.url, transport="shm", shm_size=4 * 2**20)
    blob = make_blob(1, tokens=16384, key=key(1))  # 2 MiB, kept as it is
    be.put_blob(key(1), blob)
    leases = [be.lease([key(1), key(9)]) for _ in range(4)]
    assert all(bytes(lease[0]) == blob and lease[1] is None for lease in leases)
    assert be.counts == {"shm": 5}
    seg = next(iter(server.thread.server.plane.shm._segments.values()))
    assert len(seg.lent) == 4 and seg.lent_bytes == 4 * len(blob)
    offset = arena.offset_of(server.store.tiers[0].get(key(1)))
    assert all(arena.offset_of(lease[0]) is None for lease in leases)  # the client's own mapping
    with pytest.raises(TypeError):
        leases[0][0][:1] = b"x"  # read-only
    for lease in leases:
        lease.release()
    assert bytes(be.get_blob(key(1))) == blob  # a get copies out and gives its pin back at once
    be.batch_exists([key(1)])
    be.put_blob(
        key(2), make_blob(2, tokens=512, key=key(2))
    )  # the next shared-memory request carries the pins back
    assert not seg.lent and seg.lent_bytes == 0
    assert arena.offset_of(server.store.tiers[0].get(key(1))) == offset
    be.close()


def test_a_lent_blob_outlives_its_eviction_and_overwrite(server_factory):
    srv = server_factory(store={"cpu_capacity": "4MiB"})
    be = RemoteBackend(srv.url, transport="shm")
    first = make_blob(1, tokens=8192, key=key(1))  # 1 MiB
    be.put_blob(key(1), first)
    lease = be.lease([key(1)])
    be.put_blob(key(1), make_blob(2, tokens=8192, key=key(1)))  # replaced
    for i in range(3, 12):  # and everything evicted many times over: its region stays the lease's
        be.put_blob(key(i), make_blob(i, tokens=8192, key=key(i)))
    assert bytes(lease[0]) == first and verify_blob(lease[0])
    assert bytes(be.get_blob(key(11))) == make_blob(11, tokens=8192, key=key(11))
    lease.release()
    be.close()


def test_the_arena_cannot_be_mapped_writable_by_a_client(server):
    be = RemoteBackend(server.url, transport="shm")
    be.put_blob(key(1), make_blob(1, key=key(1)))
    path, size, nonce = be.plane.client.hello["arena"]
    assert shm.open_segment(path, size, nonce, writable=True) is None  # sealed: EPERM
    mapped = shm.open_segment(path, size, nonce, writable=False)
    assert mapped is not None
    mapped.close()
    be.close()


def test_same_host_clients_use_the_unix_socket_and_fall_back_to_tcp(server):
    be = RemoteBackend(server.url)
    be.put_blob(key(1), make_blob(1, key=key(1)))
    conns = be.plane.client.pool._idle
    assert conns and all(c.sock.family == socket.AF_UNIX for c in conns)
    tcp = RemoteBackend(server.url, transport="tcp")
    assert tcp.get_blob(key(1)) == make_blob(1, key=key(1))
    assert all(c.sock.family == socket.AF_INET for c in tcp.plane.client.pool._idle)
    tcp.close()
    be.close()
    plane = server.thread.server.plane
    plane.unix_path = "\0kvstore-no-such-socket"  # as a server in another network namespace seems
    be = RemoteBackend(server.url)
    for _ in range(2):
        assert bytes(be.get_blob(key(1))) == make_blob(1, key=key(1))
    assert be.plane.client.unix_path is None and all(
        c.sock.family == socket.AF_INET for c in be.plane.client.pool._idle
    )
    be.close()


def test_auth_applies_to_the_data_plane(server_factory):
    srv = server_factory(auth_token=TOKEN)
    for transport in ("shm", "tcp"):
        for token in (None, "wrong"):
            with pytest.raises(Unauthorized):
                RemoteBackend(srv.url, token=token, transport=transport, retries=0).get_blob(key(1))
        be = RemoteBackend(srv.url, token=TOKEN, transport=transport)
        be.put_blob(key(1), make_blob(1, tokens=512, key=key(1)))
        assert bytes(be.get_blob(key(1))) == make_blob(1, tokens=512, key=key(1))
        be.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_limits_and_checks_apply_unchanged(server_factory, transport):
    srv = server_factory({"max_blob_size": 1 << 20}, max_request_size=3 << 20)
    be = RemoteBackend(srv.url, transport=transport)
    before = srv.usage()
    big = make_blob(1, tokens=1 << 14)  # 2 MiB
    with pytest.raises(TooLarge):
        be.put_blob(key(1), big)
    blob = make_blob(2, tokens=8000)  # 1 MiB - a little
    with pytest.raises(TooLarge):  # 4 of them: over max_request_size
        be.batch_put([(key(i), blob) for i in range(4)])
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(CorruptBlob):
        be.put_blob(key(3), bytes(bad))
    with pytest.raises(CorruptBlob):  # a batch with one bad blob stores none of them
        be.batch_put([(key(4), blob), (key(5), bytes(bad))])
    with pytest.raises(InvalidKey):
        be.put_blob("not-hex", blob)
    with pytest.raises(InvalidArgument):
        be.batch_exists([key(i) for i in range(5000)])
    assert srv.usage() == before
    be.close()


def test_fallbacks(server_factory, monkeypatch):
    http_only = server_factory(dataplane=False)
    be = RemoteBackend(http_only.url)
    be.put_blob(key(1), make_blob(1, key=key(1)))
    assert be.transport == "http" and bytes(be.get_blob(key(1))) == make_blob(1, key=key(1))
    with pytest.raises(Unavailable):
        RemoteBackend(http_only.url, transport="tcp").get_blob(key(1))

    no_shm = server_factory(shm_budget=0)
    be = RemoteBackend(no_shm.url)
    be.put_blob(key(1), make_blob(1, tokens=512, key=key(1)))
    assert be.transport == "tcp" and bytes(be.get_blob(key(1))) == make_blob(1, tokens=512, key=key(1))
    with pytest.raises(Unavailable):
        RemoteBackend(no_shm.url, transport="shm").get_blob(key(1))

    srv = server_factory(shm_budget=64 << 20)
    first = RemoteBackend(srv.url, shm_size=64 << 20)
    assert first.transport == "shm"
    second = RemoteBackend(srv.url)  # the budget is spent: TCP
    assert second.transport == "tcp"
    first.close()

    plane = srv.thread.server.plane
    wait_for(lambda: plane.shm.used == 0)
    monkeypatch.setattr(shm, "open_segment", lambda *a: None)  # as in another PID namespace
    third = RemoteBackend(srv.url)
    third.put_blob(key(2), make_blob(2, tokens=512, key=key(2)))
    assert third.transport == "tcp" and bytes(third.get_blob(key(2))) == make_blob(2, tokens=512, key=key(2))
    wait_for(lambda: plane.shm.used == 0)  # the segment it could not map was freed
    assert srv.thread.state.metrics.totals["errors"] == 0
    second.close()
    third.close()


def test_segments_go_with_their_connections(server):
    plane = server.thread.server.plane
    before = memfds()
    be = RemoteBackend(server.url, transport="shm", pool_size=2)
    be.put_blob(key(1), make_blob(1, tokens=512, key=key(1)))
    assert len(plane.shm) == 1 and memfds() > before
    be.close()
    wait_for(lambda: len(plane.shm) == 0 and plane.shm.used == 0 and memfds() == before)


def test_calls_to_a_same_host_server_poll_before_sleeping_unless_told_not_to(server):
    spinning = RemoteBackend(server.url, transport="tcp")
    still = RemoteBackend(server.url, transport="tcp", spin_us=0)
    blob = make_blob(7, tokens=512, key=key(7))
    spinning.put_blob(key(7), blob)
    assert bytes(still.get_blob(key(7))) == blob == bytes(spinning.get_blob(key(7)))
    conns = lambda be: be.plane.client.pool._idle  # noqa: E731
    assert {c.spin_s for c in conns(spinning)} == {200e-6} and {c.spin_s for c in conns(still)} == {0.0}
    for bad in (-1, float("nan"), 2e6, "10"):
        with pytest.raises(InvalidArgument, match="spin_us"):
            RemoteBackend(server.url, spin_us=bad)
    spinning.close()
    still.close()


def test_a_spinning_wait_gets_early_late_and_no_answers_right() -> None:
    """The poll-then-sleep wait on a socket pair: data already there, data after the poll gave up
    (the socket's own timeout then applies), no data (that timeout), the peer gone (an error)."""
    a, b = socket.socketpair()
    a.settimeout(0.5)
    conn = sdp._Conn(a)
    conn.spin_s = 200e-6
    view = memoryview(bytearray(16))
    b.sendall(b"early")
    assert conn._recv(view) == 5 and bytes(view[:5]) == b"early"
    threading.Timer(0.05, b.sendall, [b"late"]).start()
    assert conn._recv(view) == 4 and bytes(view[:4]) == b"late"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        conn._recv(view)
    assert 0.4 < time.monotonic() - t0 < 2.0
    b.close()
    with pytest.raises(ConnectionError):
        conn._recv(view)
    assert sdp._spinners == 0, "every wait gave its spinning slot back"
    a.close()
