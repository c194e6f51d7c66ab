"""The binary data plane on the HTTP port, spoken byte by byte: framing, auth, limits and stalls are
answered as the HTTP routes answer them, and a bad client only ever loses its own connection."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from kvstore.sdk.remote import RemoteBackend

from kvstore.protocol import dataplane as dp
from kvstore.protocol import shm
from tests.sdk.test_transports import wait_for
from tests.server.conftest import key, make_blob


class Raw:
    """A data-plane connection with nothing of the SDK in between."""

    def __init__(self, port: int, hello: bool = True, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(dp.PREFACE)
        if hello:
            head, meta, _ = self.call(dp.HELLO, {"v": dp.VERSION, "token": token})
            assert head.status == 200, meta

    def send(
        self, op: int, meta: dict, body: bytes = b"", flags: int = 0, body_len: int | None = None
    ) -> None:
        packed = dp.pack_meta(meta)
        n = len(body) if body_len is None else body_len
        self.sock.sendall(dp.pack_head(op, packed, n, flags) + body)

    def receive(self) -> tuple[dp.Head, dict, bytes]:
        data = self._exactly(dp.HEAD_SIZE)
        head = dp.parse_head(data)
        meta = dp.parse_meta(self._exactly(head.meta_len))
        return head, meta, self._exactly(head.body_len)

    def call(self, op: int, meta: dict, body: bytes = b"", flags: int = 0) -> tuple[dp.Head, dict, bytes]:
        self.send(op, meta, body, flags)
        return self.receive()

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out


def test_put_get_exists_delete_lookup(server):
    c = Raw(server.port)
    blob = make_blob(1, key=key(1))
    head, meta, _ = c.call(dp.PUT, {"k": [key(1)], "l": [len(blob)]}, blob)
    assert head.status == 201 and meta["stored"] == 1
    head, meta, body = c.call(dp.GET, {"k": [key(1), key(2)]})
    assert head.status == 200 and meta["l"] == [len(blob), -1] and body == blob
    head, meta, body = c.call(dp.GET, {"k": [key(2)]})
    assert head.status == 404 and meta["l"] == [-1] and body == b""
    assert c.call(dp.EXISTS, {"k": [key(1), key(2)]})[1]["e"] == [True, False]
    assert c.call(dp.LOOKUP, {"k": [key(1), key(2), key(1)]})[1]["n"] == 1
    assert c.call(dp.DELETE, {"k": [key(1)]})[1]["d"] == [True]
    assert server.usage() == (0, 0)


def test_http_and_the_data_plane_share_the_port(server):
    be = RemoteBackend(server.url, transport="http")
    be.put_blob(key(1), make_blob(1, key=key(1)))
    c = Raw(server.port)
    assert c.call(dp.GET, {"k": [key(1)]})[2] == make_blob(1, key=key(1))
    text = bytes(be.http.request("GET", "/metrics").body).decode()
    assert 'kvstore_http_requests_total{op="get",status="200"} 1.0' in text  # the data plane's get
    be.close()


def test_the_first_message_must_be_hello(server_factory):
    srv = server_factory(auth_token="tok")
    c = Raw(srv.port, hello=False)
    head, meta, _ = c.call(dp.GET, {"k": [key(1)]})
    assert head.status == 401 and meta["type"] == "Unauthorized" and c.closed()
    for token in (None, "wrong"):
        c = Raw(srv.port, hello=False)
        head, meta, _ = c.call(dp.HELLO, {"v": dp.VERSION, "token": token})
        assert head.status == 401 and c.closed()
    c = Raw(srv.port, token="tok")
    assert c.call(dp.EXISTS, {"k": [key(1)]})[1]["e"] == [False]


@pytest.mark.parametrize(
    "what,send,status,type_name",
    [
        ("bad preface", lambda c: c.sock.sendall(b"junk" * 4), 400, "InvalidArgument"),
        ("huge meta", lambda c: c.sock.sendall(struct.pack("<BBHIQ", dp.EXISTS, 0, 0, dp.MAX_META + 1, 0)),
         400, "InvalidArgument"),
        ("body too large", lambda c: c.send(dp.PUT, {"k": [key(1)], "l": [1 << 30]}, body_len=1 << 30), 413,
         "TooLarge"),
        ("lengths contradict the body", lambda c: c.send(dp.PUT, {"k": [key(1)], "l": [10]}, body_len=20),
         400, "InvalidArgument"),
        ("a get with a body", lambda c: c.send(dp.GET, {"k": [key(1)]}, body_len=5), 400, "InvalidArgument"),
    ],
)  # fmt: skip
def test_framing_errors_close_only_that_connection(server, what, send, status, type_name):
    before = server.usage()
    other = Raw(server.port)
    c = Raw(server.port, hello=what != "bad preface")
    if what == "bad preface":
        c = Raw.__new__(Raw)
        c.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        c.sock.sendall(dp.PREFACE[:1])
    send(c)
    head, meta, _ = c.receive()
    assert (head.status, meta["type"]) == (status, type_name)
    assert c.closed()
    assert other.call(dp.EXISTS, {"k": [key(1)]})[0].status == 404  # another client is unaffected
    assert server.usage() == before


@pytest.mark.parametrize(
    "meta,type_name",
    [({"k": ["nothex"]}, "InvalidKey"), ({"k": []}, "InvalidArgument"), ({"k": [key(1)] * 5000}, "InvalidArgument"),
     ({"x": 1}, "InvalidArgument")],
)  # fmt: skip
def test_bad_requests_are_answered_and_the_connection_stays(server, meta, type_name):
    c = Raw(server.port)
    head, reply, _ = c.call(dp.EXISTS, meta)
    assert head.status == 400 and reply["type"] == type_name
    assert c.call(dp.EXISTS, {"k": [key(1)]})[0].status == 404


def test_a_corrupt_blob_is_refused_and_nothing_is_stored(server):
    c = Raw(server.port)
    bad = bytearray(make_blob(1))
    bad[-1] ^= 1
    blob = make_blob(2)
    head, meta, _ = c.call(dp.PUT, {"k": [key(2), key(1)], "l": [len(blob), len(bad)]}, blob + bytes(bad))
    assert head.status == 422 and meta["type"] == "CorruptBlob"
    assert server.usage() == (0, 0)


def test_a_stalled_body_times_out(server_factory):
    srv = server_factory(body_timeout=0.3)
    c = Raw(srv.port)
    c.send(dp.PUT, {"k": [key(1)], "l": [1000]}, b"x" * 10, body_len=1000)
    start = time.monotonic()
    head, meta, _ = c.receive()
    assert head.status == 400 and "truncated" in meta["error"] and time.monotonic() - start < 5
    assert c.closed() and srv.usage() == (0, 0)


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_shared_memory_regions_are_checked(server):
    c = Raw(server.port)
    head, meta, _ = c.call(dp.SHM_OPEN, {"size": 4 << 20})
    seg_id, size = meta["seg"], meta["size"]
    mapped = shm.open_segment(meta["path"], size, meta["nonce"])
    assert mapped is not None and mapped.size() == size
    blob = make_blob(1, key=key(1))
    mapped[shm.DATA_START : shm.DATA_START + len(blob)] = blob
    put = {"k": [key(1)], "l": [len(blob)], "s": [seg_id, shm.DATA_START, len(blob)]}
    assert c.call(dp.PUT, put, flags=dp.FLAG_SHM)[0].status == 201
    get = {"k": [key(1)], "s": [seg_id, 2 * shm.DATA_START, 1 << 20]}
    head, meta, _ = c.call(dp.GET, get, flags=dp.FLAG_SHM)
    assert head.flags & dp.FLAG_SHM and meta["o"] == 2 * shm.DATA_START
    assert mapped[2 * shm.DATA_START : 2 * shm.DATA_START + len(blob)] == blob
    for region in ([seg_id, 0, 100], [seg_id, size - 10, 100], [seg_id + 1, shm.DATA_START, 100]):
        head, meta, _ = c.call(dp.GET, {"k": [key(1)], "s": region}, flags=dp.FLAG_SHM)
        assert head.status == 400 and meta["type"] == "InvalidArgument"
    other = Raw(server.port)  # a segment is this connection's unless attached with its nonce
    assert other.call(dp.GET, get, flags=dp.FLAG_SHM)[0].status == 400
    assert other.call(dp.SHM_ATTACH, {"seg": seg_id, "nonce": b"x" * 16})[0].status == 400
    assert other.call(dp.SHM_ATTACH, {"seg": seg_id, "nonce": bytes(mapped[8:24])})[0].status == 200
    assert other.call(dp.GET, get, flags=dp.FLAG_SHM)[0].status == 200
    mapped.close()


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_lending_needs_the_arena_nonce_and_pins_are_checked(server):
    c = Raw(server.port)
    blob = make_blob(1, tokens=512, key=key(1))  # kept, and lent, as it is
    assert c.call(dp.PUT, {"k": [key(1)], "l": [len(blob)]}, blob)[0].status == 201
    _, hello, _ = c.call(dp.HELLO, {"v": dp.VERSION})
    path, size, nonce = hello["arena"]
    _, meta, _ = c.call(dp.SHM_OPEN, {"size": 4 << 20})
    seg_id = meta["seg"]
    region = [seg_id, shm.DATA_START, 1 << 20]
    head, meta, _ = c.call(dp.GET, {"k": [key(1), key(2)], "s": region, "a": b"x" * 16}, flags=dp.FLAG_SHM)
    assert head.flags & dp.FLAG_SHM and "a" not in meta and meta["o"] == shm.DATA_START  # copied
    head, meta, _ = c.call(dp.GET, {"k": [key(1), key(2)], "s": region, "a": nonce}, flags=dp.FLAG_SHM)
    assert head.status == 200 and meta["l"] == [len(blob), -1] and meta["a"][1] == -1
    arena = shm.open_segment(path, size, nonce, writable=False)
    assert arena[meta["a"][0] : meta["a"][0] + len(blob)] == blob
    seg = server.thread.server.plane.shm._segments[seg_id]
    assert list(seg.lent) == [meta["p"]]
    for bad in ("1", [1.5], ["x"], list(range(dp.MAX_PINS + 1))):
        head, reply, _ = c.call(dp.GET, {"k": [key(1)], "s": region, "u": bad}, flags=dp.FLAG_SHM)
        assert head.status == 400 and reply["type"] == "InvalidArgument"
    assert list(seg.lent) == [meta["p"]]
    c.call(dp.GET, {"k": [key(3)], "s": region, "u": [meta["p"] + 1000, meta["p"]]}, flags=dp.FLAG_SHM)
    assert not seg.lent and seg.lent_bytes == 0
    arena.close()


def test_a_server_without_the_data_plane_answers_it_with_http(server_factory):
    srv = server_factory(dataplane=False)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(dp.PREFACE + dp.pack_head(dp.HELLO, dp.pack_meta({"v": 1})))
        answer = s.recv(4096)
    assert (
        answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0]
    )  # JSON, as for any bad request


def test_limits_of_the_http_side_apply(server_factory):
    srv = server_factory(keepalive_timeout=0.5)
    idle = Raw(srv.port)  # said HELLO, then nothing: closed after keepalive_timeout
    start = time.monotonic()
    assert idle.closed() and time.monotonic() - start < 5
    srv = server_factory(header_timeout=0.3, max_connections=4)
    half = Raw(srv.port)
    half.sock.sendall(dp.pack_head(dp.EXISTS, dp.pack_meta({"k": [key(1)]}))[:10])  # half a header
    head, meta, _ = half.receive()
    assert head.status == 408 and half.closed()
    hogs = [Raw(srv.port) for _ in range(4)]  # the limit counts data-plane connections too
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
    for h in hogs:
        h.sock.close()


def test_put_bodies_share_the_http_body_budget(server_factory):
    srv = server_factory(max_body_bytes_in_flight=2 << 20)
    big = make_blob(1, tokens=8000)  # ~1000 KiB
    slow = Raw(srv.port)
    slow.send(dp.PUT, {"k": [key(1)], "l": [len(big)]}, big[:1000], body_len=len(big))  # and waits
    wait_for(lambda: srv.thread.state.budget.used == len(big))  # its body is reserved
    other = Raw(srv.port)
    head, meta, _ = other.call(dp.PUT, {"k": [key(2)], "l": [len(big)]}, big)
    assert head.status == 503 and meta["type"] == "Busy" and meta["retry_after"] == 1
    assert head.flags & dp.FLAG_CLOSE and other.closed()  # its body could not be skipped
    assert srv.thread.state.budget.used == len(big)
    slow.sock.sendall(big[1000:])
    assert slow.receive()[0].status == 201
    assert srv.thread.state.budget.used == 0


def test_an_answer_a_client_does_not_read_is_budgeted_and_times_out(server_factory):
    srv = server_factory(body_timeout=0.5)
    blob = make_blob(1, tokens=1 << 18)  # 32 MiB: more than the socket buffers hold
    RemoteBackend(srv.url, transport="tcp").put_blob(key(1), blob)
    c = Raw(srv.port)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.send(dp.GET, {"k": [key(1)]})  # and never reads the answer
    budget = srv.thread.state.budget
    wait_for(lambda: budget.used > 0)
    wait_for(lambda: budget.used == 0)  # closed after body_timeout, its blobs let go
    assert len(srv.thread.server.plane.connections) == 0


def test_a_client_without_the_token_holds_no_body_budget(server_factory):
    """Issue 30 #9: PUT headers declaring big bodies, sent before (or instead of) HELLO, reserve
    nothing: each is a 401 from its 16-byte header and the connection closes; an authenticated put
    still fits. A HELLO announcing a large meta is refused before the meta is received."""
    srv = server_factory(auth_token="tok", max_body_bytes_in_flight=64 << 20)
    hogs = [Raw(srv.port, hello=False) for _ in range(16)]
    for h in hogs:
        h.send(dp.PUT, {"k": [key(1)], "l": [32 << 20]}, body_len=32 << 20)  # and no body, ever
    for h in hogs:
        head, meta, _ = h.receive()
        assert head.status == 401 and meta["type"] == "Unauthorized" and h.closed()
    assert srv.thread.state.budget.used == 0
    blob = make_blob(2, tokens=8000)
    c = Raw(srv.port, token="tok")
    assert c.call(dp.PUT, {"k": [key(2)], "l": [len(blob)]}, blob)[0].status == 201
    big_hello = Raw(srv.port, hello=False)
    big_hello.sock.sendall(struct.pack("<BBHIQ", dp.HELLO, 0, 0, dp.MAX_META, 0))  # the meta never comes
    start = time.monotonic()
    head, meta, _ = big_hello.receive()
    assert head.status == 400 and big_hello.closed() and time.monotonic() - start < 2  # not the deadline
