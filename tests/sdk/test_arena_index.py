"""Same-host gets without a request: the server publishes where each cpu-arena blob lies
(kvstore.tiers.arena_index, read through kvstore.protocol.arena_table) and the SDK copies blobs out when the entry stays unchanged across the
copy. Never a stale or torn blob, never a write into the table from a client, and the server still
sees every read (TOUCH): hits counted, LRU recency refreshed."""

from __future__ import annotations

import random
import re
import socket
import threading
import time
import urllib.request

import pytest
import torch
from kvstore.sdk import Store
from kvstore.sdk import transfers as tr
from kvstore.sdk.buffers import BufferPool
from kvstore.sdk.remote import RemoteBackend
from kvstore.sdk.shm import ClientArena

from kvstore.blob import verify_blob
from kvstore.lru import LRUIndex
from kvstore.protocol import dataplane as dp
from kvstore.protocol import shm
from kvstore.protocol.arena_table import STALE_S, IndexReader, usable_here
from kvstore.tiers.arena_index import ArenaIndex, PublishedLRU
from kvstore.tiers.cpu import CpuTier
from tests.server.conftest import key, make_blob, wait_for

pytestmark = pytest.mark.skipif(
    not (shm.available() and usable_here()), reason="needs memfd, /proc and x86-64"
)
MiB = 2**20


def cpu_hits(be: RemoteBackend) -> int:
    return next(t for t in be.stats()["tiers"] if t["name"] == "cpu")["hits"]


def test_gets_and_leases_of_arena_blobs_need_no_request(server):
    be = RemoteBackend(server.url, transport="shm")
    blobs = {i: make_blob(i, tokens=4096, key=key(i)) for i in range(1, 4)}  # 512 KiB each, kept as they are
    be.batch_put([(key(i), b) for i, b in blobs.items()])
    seg = next(iter(server.thread.server.plane.shm._segments.values()))
    assert bytes(be.get_blob(key(1))) == blobs[1]
    assert [bytes(b) for b in be.batch_get([key(2), key(3)])] == [blobs[2], blobs[3]]
    reasons: list = []
    with be.lease([key(3), key(1)], reasons) as got:
        assert [bytes(b) for b in got] == [blobs[3], blobs[1]] and reasons == [None, None]
        assert got.headers == [verify_blob(b) for b in got]  # verified by the SDK as it copied
    assert be.counts["index"] == 3 and not seg.lent  # nothing was lent: nothing to give back
    wait_for(lambda: cpu_hits(be) == 5, timeout=5)  # the server counted every read (TOUCH), as gets
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    # counted as what clients reported, apart from the requests the server served and measured
    assert 'kvstore_reported_gets_total{op="get"} 1.0' in text
    assert 'kvstore_reported_gets_total{op="batch_get"} 2.0' in text
    assert 'kvstore_http_requests_total{op="get",status="200"}' not in text
    # a miss anywhere in the batch: the whole batch asks the server, which answers as before
    assert be.batch_get([key(1), key(9)])[1] is None and be.counts["index"] == 3
    be.close()


def test_large_leases_are_lent_where_they_lie_instead_of_copied(server):
    """Over INDEX_LEASE_MAX bytes a round trip costs less than a copy: the server lends them; a get
    (which copies either way) still needs no request."""
    be = RemoteBackend(server.url, transport="shm")
    blobs = [make_blob(i, tokens=8000, key=key(i)) for i in range(4)]  # 1,000 KiB each
    be.batch_put([(key(i), b) for i, b in enumerate(blobs)])
    keys = [key(i) for i in range(4)]
    with be.lease(keys[:3]) as got:
        assert [bytes(b) for b in got] == blobs[:3]
        assert be.counts["index"] == 1  # under 3 MiB: copied out
    with be.lease(keys) as got:
        assert [bytes(b) for b in got] == blobs and got.headers == [None] * 4  # lent: the caller verifies
        assert be.counts["index"] == 1 and be.counts["shm"] == 2
    assert [bytes(b) for b in be.batch_get(keys)] == blobs and be.counts["index"] == 2
    be.close()


def test_deleted_replaced_and_evicted_blobs_are_never_read_from_the_table(server_factory):
    srv = server_factory(store={"cpu_capacity": "4MiB"})
    be = RemoteBackend(srv.url, transport="shm")
    be.put_blob(key(1), make_blob(1, tokens=4096, key=key(1)))
    assert bytes(be.get_blob(key(1))) == make_blob(1, tokens=4096, key=key(1))
    assert be.delete(key(1))
    assert be.get_blob(key(1)) is None
    be.put_blob(key(1), make_blob(2, tokens=4096, key=key(1)))
    be.put_blob(key(1), make_blob(3, tokens=4096, key=key(1)))  # replaced
    assert bytes(be.get_blob(key(1))) == make_blob(3, tokens=4096, key=key(1))
    wait_for(
        lambda: cpu_hits(be) == 2, timeout=5
    )  # the reads' reports (their recency) land before what follows
    for i in range(10, 20):  # 5 MiB more: key(1) is evicted
        be.put_blob(key(i), make_blob(i, tokens=4096, key=key(i)))
    assert be.get_blob(key(1)) is None
    assert bytes(be.get_blob(key(19))) == make_blob(19, tokens=4096, key=key(19))
    assert be.counts["index"] == 3
    be.close()


def test_reads_during_overwrites_and_evictions_get_whole_blobs(server_factory):
    """Readers race a writer that replaces and evicts at capacity: every read is one of the blobs that
    were stored under that key (or a miss once evicted), never torn bytes."""
    srv = server_factory(store={"cpu_capacity": "3MiB"})
    writer = RemoteBackend(srv.url, transport="shm")
    variants = {k: [make_blob(10 * k + v, tokens=4096, key=key(k)) for v in range(3)] for k in range(6)}
    valid = {key(k): set(vs) for k, vs in variants.items()}
    for k, vs in variants.items():
        writer.put_blob(key(k), vs[0])
    stop = threading.Event()
    bad: list[str] = []
    readers = [RemoteBackend(srv.url, transport="shm") for _ in range(2)]

    def read(be: RemoteBackend, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            k = key(rng.randrange(6))
            got = be.get_blob(k)
            if got is not None and bytes(got) not in valid[k]:
                bad.append(k)

    threads = [threading.Thread(target=read, args=(be, i)) for i, be in enumerate(readers)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        k = rng.randrange(6)
        writer.put_blob(key(k), rng.choice(variants[k]))
    stop.set()
    for t in threads:
        t.join()
    assert not bad
    assert all(be.counts["index"] > 0 for be in readers)
    for be in [writer, *readers]:
        be.close()


def test_an_entry_that_changes_during_the_copy_sends_the_get_to_the_server():
    """The copy a reader made is thrown away when the entry's generation moved meanwhile (the blob
    was replaced while it copied), and its buffers go back to the pool."""
    tier = CpuTier(4 * MiB, memory="arena")
    blob, other = make_blob(1, tokens=2048), make_blob(2, tokens=2048)
    tier.put(key(1), blob)
    table = tier.arena_index
    s = table.segment
    reader = IndexReader(shm.open_segment(s.path, s.size, s.nonce, writable=False), table.slots, table.seed,
                         tier.arena.size)  # fmt: skip
    a = tier.arena.segment
    arena = ClientArena(a.size, a.nonce, shm.open_segment(a.path, a.size, a.nonce, writable=False), reader)

    def read(rx: tr.Receiver) -> tuple[bytes, object] | None:
        got = tr.fetch_index(arena, [key(1)], rx)
        return None if got is None else (bytes(got[0][0][0]), got[1][0])

    assert read(tr.Receiver(None)) == (blob, None)  # a get: the caller verifies
    pool = BufferPool()
    assert read(tr.Receiver(pool)) == (blob, verify_blob(blob))  # a lease: verified as it was copied

    class Racing(tr.Receiver):
        def into(self, n: int) -> memoryview:
            tier.put(key(1), other)  # lands while the reader copies
            return super().into(n)

    rx = Racing(pool)
    assert read(rx) is None and rx.frees == []
    assert read(tr.Receiver(None)) == (other, None)
    tier.delete(key(1))
    assert read(tr.Receiver(None)) is None
    arena.close()
    tier.close()


def test_the_table_names_exactly_the_arena_blobs_without_a_ttl():
    """After every put, overwrite, delete, expiry and eviction, each published entry is where the tier
    keeps that key's blob; each key the tier keeps in the arena without a TTL is published when at most
    one other key shares its pair of slots (2-way: a third key would take its home slot over)."""
    tier = CpuTier(2 * MiB, memory="arena")
    now = [0.0]
    tier._clock = lambda: now[0]
    rng = random.Random(1)
    pair = [tier.arena_index.slot(key(i).encode()) // 2 for i in range(40)]
    for step in range(400):
        k = key(rng.randrange(40))
        op = rng.random()
        if op < 0.6:
            tier.put(k, make_blob(step, tokens=rng.choice([64, 512, 2048])), ttl_s=5 if op < 0.1 else None)
        elif op < 0.75:
            tier.delete(k)
        elif op < 0.9:
            tier.get(k)
        else:
            now[0] += 3
        published = tier.arena_index.published()
        kept = {
            key_: (tier.arena.offset_of(e.value), e.size)
            for key_, e in tier._index.items()
            if e.expires_at is None and tier.arena.offset_of(e.value) is not None
        }
        assert all(kept.get(k_) == where for k_, where in published.items()), step
        for k_ in kept:
            if pair.count(tier.arena_index.slot(k_.encode()) // 2) <= 2:
                assert k_ in published, (step, k_)
    tier.close()


def test_a_server_that_stops_beating_is_asked_again(server):
    """A server that died or stopped leaves its arena mapped here: its heartbeat going stale sends
    the client's reads back to requests (which then fail, or find the server restarted)."""
    be = RemoteBackend(server.url, transport="shm")
    be.put_blob(key(1), make_blob(1, tokens=4096, key=key(1)))
    assert be.get_blob(key(1)) is not None and be.counts["index"] == 1
    server.store.tiers[0].arena_index.stop_beating()
    time.sleep(STALE_S + 0.05)
    assert bytes(be.get_blob(key(1))) == make_blob(1, tokens=4096, key=key(1))
    assert be.counts["index"] == 1 and be.counts["shm"] == 2  # the put, then this get: requests
    be.close()


def test_clients_cannot_write_the_table(server):
    be = RemoteBackend(server.url, transport="shm")
    assert be.transport == "shm"
    path, size, nonce, _, _ = be.plane.client.hello["index"]
    assert shm.open_segment(path, size, nonce, writable=True) is None  # sealed: EPERM
    assert be.plane.segment.arena.index.words.flags.writeable is False
    be.close()


def test_reads_through_the_table_refresh_recency(server_factory):
    """A blob read only through the table is not the next to be evicted: TOUCH refreshed it."""
    srv = server_factory(store={"cpu_capacity": "2MiB"})
    be = RemoteBackend(srv.url, transport="shm")
    for i in range(1, 4):  # 3 x 512 KiB
        be.put_blob(key(i), make_blob(i, tokens=4096, key=key(i)))
    assert be.get_blob(key(1)) is not None and be.counts["index"] == 1
    wait_for(lambda: cpu_hits(be) == 1, timeout=5)
    be.put_blob(key(4), make_blob(4, tokens=4096, key=key(4)))
    be.put_blob(key(5), make_blob(5, tokens=4096, key=key(5)))  # over capacity: key(2) goes, not key(1)
    assert be.batch_exists([key(1), key(2)]) == [True, False]
    be.close()


def test_read_index_false_asks_the_server_every_time(server):
    be = RemoteBackend(server.url, transport="shm", read_index=False)
    be.put_blob(key(1), make_blob(1, key=key(1)))
    assert bytes(be.get_blob(key(1))) == make_blob(1, key=key(1))
    assert be.counts["index"] == 0 and be.counts["shm"] == 1  # the get (a blob this small: put on TCP)
    be.close()


def raw_plane(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(dp.PREFACE)
    return sock


def send(sock: socket.socket, op: int, meta: dict) -> None:
    sock.sendall(dp.pack_head(op, dp.pack_meta(meta)))


def answer(sock: socket.socket) -> tuple[dp.Head, dict]:
    data = b""
    while len(data) < dp.HEAD_SIZE or len(data) < dp.HEAD_SIZE + dp.parse_head(data).meta_len:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head = dp.parse_head(data)
    return head, dp.parse_meta(data[dp.HEAD_SIZE : dp.HEAD_SIZE + head.meta_len])


def test_touch_is_never_answered_and_a_bad_one_closes_only_its_connection(server_factory):
    server = server_factory(auth_token="t0ken")
    be = RemoteBackend(server.url, token="t0ken", transport="shm")
    be.put_blob(key(1), make_blob(1, key=key(1)))
    sock = raw_plane(server.port)
    send(sock, dp.TOUCH, {"k": [key(1)], "g": [[1, 1e-4]]})  # before HELLO: refused, as every other op
    assert answer(sock)[0].status == 401
    sock.close()
    sock = raw_plane(server.port)
    send(sock, dp.HELLO, {"v": dp.VERSION, "token": "t0ken"})
    assert answer(sock)[0].status == 200
    send(sock, dp.TOUCH, {"k": [key(1)], "g": [[1, 1e-4]]})
    send(sock, dp.EXISTS, {"k": [key(1)]})
    head, meta = answer(sock)  # the first answer on the connection is the EXISTS one
    assert head.op == dp.EXISTS and meta["e"] == [True]
    send(sock, dp.TOUCH, {"k": ["not a key"], "g": [[1, 1e-4]]})
    sock.settimeout(5)
    assert sock.recv(1) == b""  # closed, without an answer
    sock.close()
    assert bytes(be.get_blob(key(1))) == make_blob(1, key=key(1)) and be.exists(
        key(1)
    )  # others are unaffected
    be.close()


def test_a_table_for_a_plain_lru_is_not_made():
    tier = CpuTier(MiB, memory="plain")
    assert tier.arena_index is None and type(tier._index) is LRUIndex
    shared = CpuTier(MiB, memory="arena")
    assert isinstance(shared._index, PublishedLRU) and isinstance(shared.arena_index, ArenaIndex)
    shared.close()


def test_a_touch_cannot_forge_hits_or_latency(server_factory):
    """Issue 30 #10: a client reported 81,920 gets of 3,599 s each and the server counted them as
    measured gets and hits. Now only keys the index publishes count (as top-tier hits), on a
    connection whose HELLO lent the index; seconds are at most the time since that HELLO; and the
    reports go to their own series, never to the measured request metrics."""
    server = server_factory()
    be = RemoteBackend(server.url, transport="tcp")
    be.put_blob(key(1), make_blob(1, key=key(1)))
    sock = raw_plane(server.port)
    send(sock, dp.HELLO, {"v": dp.VERSION})
    assert answer(sock)[0].status == 200  # its HELLO lent the index
    hello_at = time.monotonic()
    absent = [key(100 + i) for i in range(4000)]
    for _ in range(20):  # 20 messages of forged reports: 80,000 absent keys, a few present ones
        send(
            sock,
            dp.TOUCH,
            {"k": [*absent, key(1), key(1)], "g": [[len(absent), 3599.0], [1, 3599.0], [1, 0.5]]},
        )
    send(sock, dp.EXISTS, {"k": [key(1)]})
    assert answer(sock)[1]["e"] == [True]  # every TOUCH before it was handled
    elapsed = time.monotonic() - hello_at + 0.05
    stats = be.stats()
    assert stats["misses"] == 0 and cpu_hits(be) == 40  # the present key, twice a message; no miss
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert 'kvstore_reported_gets_total{op="get"} 40.0' in text  # the 4,000-key gets named absent keys
    assert 'kvstore_reported_gets_total{op="batch_get"}' not in text
    total = float(re.search(r'kvstore_reported_get_seconds_sum\{op="get"\} ([\d.e+-]+)', text).group(1))
    assert total <= 20 * (0.5 + elapsed), total  # not 20 x 3599 s: at most the time since the HELLO
    assert 'kvstore_request_seconds_count{op="get"}' not in text and 'op="get",status="200"' not in text
    sock.close()
    be.close()


def test_in_place_leases_of_real_chunks_need_no_request_and_no_copy(server):
    """A lease of SmolLM2-sized chunks (5.9 MB each) `in_place`: views of the arena where the index
    says the blobs lie, whole (intact) while nothing overwrites them; no request, nothing lent."""
    be = RemoteBackend(server.url, transport="shm")
    blobs = [make_blob(i, tokens=46_000, key=key(i)) for i in range(3)]  # 5.75 MiB each
    be.batch_put([(key(i), b) for i, b in enumerate(blobs)])
    seg = next(iter(server.thread.server.plane.shm._segments.values()))
    asked = dict(be.counts)
    reasons: list = []
    with be.lease([key(2), key(0)], reasons, in_place=True) as got:
        assert [bytes(b) for b in got] == [blobs[2], blobs[0]] and reasons == [None, None]
        assert all(b.readonly for b in got) and got.headers == [verify_blob(b) for b in got]  # parsed
        assert got.intact() == [True, True]
        views = list(got.blobs)
    assert be.counts["in_place"] == 1 and {k: be.counts[k] for k in asked} == asked  # no request
    assert not seg.lent
    with pytest.raises(ValueError):
        bytes(views[0])  # released with the lease
    wait_for(lambda: cpu_hits(be) == 2, timeout=5)  # the server still counts both reads (TOUCH)
    with be.lease([key(0), key(9)], in_place=True) as got:  # a miss: the server answers, as before
        assert bytes(got[0]) == blobs[0] and got[1] is None and got.intact() == [True, True]
    assert be.counts["in_place"] == 1
    be.close()


def test_an_in_place_lease_says_which_blobs_were_overwritten_while_out(server_factory):
    """The server may reuse a region while an in-place lease is out: `intact()` says so for exactly
    the blobs deleted, replaced or evicted since the lease began."""
    srv = server_factory(store={"cpu_capacity": "3MiB"})
    be = RemoteBackend(srv.url, transport="shm")
    for i in range(3):
        be.put_blob(key(i), make_blob(i, tokens=4096, key=key(i)))  # 512 KiB each
    with be.lease([key(0), key(1), key(2)], in_place=True) as got:
        assert got.intact() == [True, True, True]
        be.put_blob(key(1), make_blob(11, tokens=4096, key=key(1)))  # replaced
        assert got.intact() == [True, False, True]
        be.delete(key(2))
        assert got.intact() == [True, False, False]
    with be.lease([key(0), key(1)], in_place=True) as got:
        # 6 MiB more, twice the capacity (whatever recency the lease's touches gave them): key(0) and
        # key(1) are evicted, their regions reused
        for i in range(20, 32):
            be.put_blob(key(i), make_blob(i, tokens=4096, key=key(i)))
        assert got.intact() == [False, False]
    be.close()


def test_sdk_gets_decode_in_place_and_ask_again_for_a_blob_overwritten_meanwhile(server, monkeypatch):
    """Store.get / batch_get read in place; a blob the server overwrote while it was decoded is asked
    for again (never the torn decode)."""
    store = Store.connect(server.url, transport="shm")
    kvs = [torch.randn(2, 2, 256, 4, 64, generator=torch.Generator().manual_seed(i)).half() for i in range(3)]
    store.batch_put([(key(i), kv) for i, kv in enumerate(kvs)])
    assert torch.equal(store.get(key(0)), kvs[0]) and store.backend.counts["in_place"] == 1
    decode, raced = store.decode, []

    def racing_decode(k, blob, *args, **kw):  # the server replaces key(1) while the SDK decodes it
        out = decode(k, blob, *args, **kw)
        if k == key(1) and not raced:
            raced.append(k)
            store.backend.put_blob(key(1), store.encode(kvs[2], key(1)))
        return out

    monkeypatch.setattr(store, "decode", racing_decode)
    got = store.batch_get([key(0), key(1)])
    assert raced and torch.equal(got[0], kvs[0]) and torch.equal(got[1], kvs[2])  # asked again
    assert store.backend.counts["in_place"] == 2
    store.close()
