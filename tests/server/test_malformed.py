"""Every malformed request gets a 4xx JSON error and leaves the store exactly as it was.

Spoken over raw sockets, so that lengths, framing and bodies can be as wrong as a broken client makes them.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import msgpack
import pytest

from kvstore.protocol import wire
from tests.blobs import kept
from tests.kvstore.test_blob import forge
from tests.server.conftest import RawResponse, key, make_blob, read_response, wait_for

BLOB_LIMIT = 64 * 1024
REQUEST_LIMIT = 256 * 1024


@pytest.fixture
def srv(server_factory):
    s = server_factory(store={"max_blob_size": BLOB_LIMIT}, max_request_size=REQUEST_LIMIT, body_timeout=1.0)
    assert s.request("PUT", wire.chunk_path(key(0)), make_blob(0)).status == 201
    return s


def assert_rejected(srv, r: RawResponse, status: int, type_name: str, before: tuple[int, int]) -> None:
    assert r.status == status, (r.status, r.body)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["type"] == type_name and body["error"], body
    assert srv.usage() == before, "a rejected request changed the store"
    assert srv.request("GET", wire.chunk_path(key(0))).body == kept(make_blob(0), key(0))


def frame(keys, lens, payload: bytes = b"") -> bytes:
    head = msgpack.packb({"keys": keys, "lens": lens})
    return struct.pack("<4sI", b"KVB1", len(head)) + head + payload


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/chunks/XYZ"), ("HEAD", "/v1/chunks/ABCDEF" + "0" * 26), ("DELETE", "/v1/chunks/" + "a" * 31),
     ("PUT", "/v1/chunks/" + "g" * 32), ("PUT", "/v1/chunks/" + "a" * 130),
     ("PUT", wire.chunk_path(key(0)) + "%0a"), ("GET", wire.chunk_path(key(0)) + "%0a"),
     ("PUT", wire.chunk_path(key(0)) + "%0d"), ("DELETE", wire.chunk_path(key(0)) + "%0A")],
)  # fmt: skip
def test_bad_key(srv, method, path):
    before = srv.usage()
    r = srv.request(method, path, make_blob(1) if method == "PUT" else b"")
    if method == "HEAD":
        assert r.status == 400 and srv.usage() == before  # HEAD answers carry no body
        return
    assert_rejected(srv, r, 400, "InvalidKey", before)


@pytest.mark.parametrize(
    "body",
    [b"", b"not a blob", make_blob(1)[:-1], make_blob(1) + b"x",
     make_blob(1)[:60] + bytes([make_blob(1)[60] ^ 1]) + make_blob(1)[61:],
     forge(make_blob(1), make_blob(1)[52:-8])],  # valid checksum, payload shorter than its shape
    ids=["empty", "garbage", "short", "long", "bitflip", "forged-length"],
)  # fmt: skip
def test_corrupt_blob(srv, body):
    before = srv.usage()
    assert_rejected(srv, srv.request("PUT", wire.chunk_path(key(1)), body), 422, "CorruptBlob", before)


def test_corrupt_blob_does_not_replace_a_good_one(srv):
    before = srv.usage()
    assert_rejected(
        srv, srv.request("PUT", wire.chunk_path(key(0)), b"junk" * 20), 422, "CorruptBlob", before
    )


def test_truncated_body_on_an_open_connection(srv):
    before = srv.usage()
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n"
    start = time.monotonic()
    r = srv.raw(head.encode() + blob[: len(blob) // 2])  # the rest never comes; the socket stays open
    assert time.monotonic() - start < 5
    assert_rejected(srv, r, 400, "InvalidArgument", before)
    assert "truncated" in r.json()["error"]


def test_truncated_body_then_hangup(srv):
    before = srv.usage()
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(head.encode() + blob[:100])
        s.shutdown(socket.SHUT_WR)
        try:
            r = read_response(s)
            assert 400 <= r.status < 500
        except (ConnectionError, OSError):
            pass  # closing mid-body leaves nobody to answer; what matters is that nothing is stored
    wait_for(lambda: srv.thread.state.metrics.connections() == 0)  # the server is done with it
    assert srv.usage() == before


def test_content_length_shorter_than_body(srv):
    """Content-Length says less than the client sends: the tail would be parsed as the next request."""
    before = srv.usage()
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {len(blob) - 10}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(head.encode() + blob)
        first = read_response(s)
        # Either the cut blob is refused (422), or the parser, which sees the stray tail in the same read,
        # refuses the whole exchange as a bad request (400). Both are JSON, and nothing is stored.
        if first.status == 422:
            assert_rejected(srv, first, 422, "CorruptBlob", before)
        else:
            assert_rejected(srv, first, 400, "InvalidArgument", before)
            assert len(first.body) < 1000  # the error does not echo the blob back
    assert srv.usage() == before


def test_bad_content_length_header(srv):
    before = srv.usage()
    r = srv.raw(
        f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: -5\r\n\r\n".encode()
    )
    assert_rejected(srv, r, 400, "InvalidArgument", before)


def test_oversized_blob_rejected_before_the_body(srv):
    before = srv.usage()
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {BLOB_LIMIT + 1}\r\n\r\n"
    assert_rejected(srv, srv.raw(head.encode()), 413, "TooLarge", before)  # not a byte of body sent


def test_oversized_blob_sent_in_full(srv):
    before = srv.usage()
    big = make_blob(1, tokens=2048)  # 128 KiB > the 64 KiB limit
    assert_rejected(srv, srv.request("PUT", wire.chunk_path(key(1)), big), 413, "TooLarge", before)


def test_oversized_chunked_body(srv):
    before = srv.usage()
    big = make_blob(1, tokens=2048)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = (
        b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (big[:70000], big[70000:])) + b"0\r\n\r\n"
    )
    assert_rejected(srv, srv.raw(head.encode() + body), 413, "TooLarge", before)


def test_chunked_body_within_limits_is_stored(srv):
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (blob[:100], blob[100:])) + b"0\r\n\r\n"
    assert srv.raw(head.encode() + body).status == 201
    assert srv.request("GET", wire.chunk_path(key(1))).body == kept(blob, key(1))


@pytest.mark.parametrize(
    "te,status",
    [("chunked", 201), ("Chunked", 201), ("identity, chunked", 501), ("gzip, chunked", 501),
     ("chunked, chunked", 400), ("identity", 400)],
)  # fmt: skip
def test_transfer_codings_other_than_chunked_are_not_implemented(srv, te, status):
    """Issue 30 #12, RFC 9112 section 6.1: a transfer coding the server does not understand is a 501;
    aiohttp stored `identity, chunked` and `gzip, chunked` bodies de-chunked, the other coding ignored."""
    before = srv.usage()
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: {te}\r\n\r\n"
    r = srv.raw(head.encode() + f"{len(blob):x}\r\n".encode() + blob + b"\r\n0\r\n\r\n")
    if status == 201:
        assert r.status == 201
    else:
        assert_rejected(srv, r, status, "InvalidArgument", before)


def test_the_te_request_header_is_only_advice(srv):
    """`TE` lists the codings a client accepts in the answer; chunked is always acceptable and a server
    may use none (RFC 9110 section 10.1.4): a get with `TE: identity, chunked` is served as any other."""
    srv.request("PUT", wire.chunk_path(key(1)), make_blob(1))
    r = srv.request("GET", wire.chunk_path(key(1)), headers={"TE": "identity, chunked"})
    assert r.status == 200 and r.body == kept(make_blob(1), key(1))


def _batch(srv, body: bytes) -> RawResponse:
    return srv.request("POST", wire.BATCH_PUT_PATH, body, {"Content-Type": wire.BATCH_CONTENT_TYPE})


@pytest.mark.parametrize(
    "body,type_name",
    [
        (b"XXXX" + frame([key(1)], [10])[4:], "InvalidArgument"),  # bad magic
        (b"KVB1\x05", "InvalidArgument"),  # shorter than the preamble
        (struct.pack("<4sI", b"KVB1", 6) + b"\xc1\xc1\xc1\xc1\xc1\xc1", "InvalidArgument"),  # not msgpack
        (struct.pack("<4sI", b"KVB1", 1 << 30), "InvalidArgument"),  # header length beyond any limit
        (struct.pack("<4sI", b"KVB1", 100) + b"\x80", "InvalidArgument"),  # header cut short
        (frame([key(1)], [1, 2]), "InvalidArgument"),  # keys and lens differ in length
        (frame([key(1)], [-1]), "InvalidArgument"),  # a miss marker in a put
        (frame([key(1)], ["x"]), "InvalidArgument"),
        (frame(key(1), [3]), "InvalidArgument"),  # keys not a list
        (frame(["nothex"], [3], b"abc"), "InvalidKey"),
        (frame([key(1) + "\n"], [len(make_blob(1))], make_blob(1)), "InvalidKey"),  # `$` took this
        (frame([key(1)], [len(make_blob(1))], make_blob(1)[:-5]), "InvalidArgument"),  # payload short
        (frame([key(1)], [len(make_blob(1))], make_blob(1) + b"extra"), "InvalidArgument"),  # too long
        (msgpack.packb({"keys": [key(1)], "lens": [3]}), "InvalidArgument"),  # no preamble at all
    ],
    ids=["magic", "short-preamble", "not-msgpack", "huge-header", "cut-header", "len-mismatch", "negative",
         "non-int", "keys-not-list", "bad-key", "newline-key", "payload-short", "payload-long", "no-preamble"],
)  # fmt: skip
def test_bad_batch_framing(srv, body, type_name):
    before = srv.usage()
    assert_rejected(srv, _batch(srv, body), 400, type_name, before)


def test_batch_with_one_corrupt_blob_stores_nothing(srv):
    before = srv.usage()
    good, bad = make_blob(1), bytearray(make_blob(2))
    bad[-1] ^= 0xFF
    body = frame([key(1), key(2), key(3)], [len(good), len(bad), len(good)], good + bytes(bad) + good)
    assert_rejected(srv, _batch(srv, body), 422, "CorruptBlob", before)


def test_batch_over_the_limits(srv):
    before = srv.usage()
    big = make_blob(1, tokens=2048)  # one blob over max_blob_size
    assert_rejected(srv, _batch(srv, frame([key(1)], [len(big)], big)), 413, "TooLarge", before)
    blobs = [make_blob(i, tokens=1000) for i in range(5)]  # each fits; together over max_request_size
    body = frame([key(i) for i in range(1, 6)], [len(b) for b in blobs], b"".join(blobs))
    assert len(body) > REQUEST_LIMIT
    assert_rejected(srv, _batch(srv, body), 413, "TooLarge", before)


@pytest.mark.parametrize(
    "body,type_name",
    [(b"{not json", "InvalidArgument"), (b'{"keys": "abc"}', "InvalidArgument"), (b"[1, 2]", "InvalidArgument"),
     (json.dumps({"keys": [key(1), "ZZ"]}).encode(), "InvalidKey"),
     (json.dumps({"keys": [key(0) + "\n"]}).encode(), "InvalidKey"),
     (json.dumps({"keys": [key(i) for i in range(wire.MAX_BATCH_KEYS + 1)]}).encode(), "InvalidArgument")],
    ids=["not-json", "keys-not-list", "not-object", "bad-key", "newline-key", "too-many"],
)  # fmt: skip
@pytest.mark.parametrize(
    "path", [wire.BATCH_GET_PATH, wire.BATCH_EXISTS_PATH, wire.LOOKUP_PATH, wire.BATCH_DELETE_PATH]
)
def test_bad_key_lists(srv, path, body, type_name):
    before = srv.usage()
    assert_rejected(srv, srv.request("POST", path, body), 400, type_name, before)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"keys": ' + b'{"a":' * 30_000 + b"1" + b"}" * 30_001,
     b'{"keys": [' + b"9" * 5000 + b"]}", b'{"keys": [1e999999, NaN, -Infinity]}', b'{"keys": ["\\ud800"]}',
     b'{"keys": ["\xff\xfe"]}'],
    ids=["deep-array", "deep-object", "5000-digits", "inf-nan", "lone-surrogate", "not-utf8"],
)  # fmt: skip
def test_hostile_json_is_a_4xx(srv, body):
    before = srv.usage()
    r = srv.request("POST", wire.LOOKUP_PATH, body)
    assert_rejected(srv, r, 400, r.json()["type"], before)
    assert r.json()["type"] in ("InvalidArgument", "InvalidKey")


def test_non_utf8_authorization_is_a_401(server_factory):
    s = server_factory(auth_token="s3cret")
    for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer s3cret\x80", b"Bearer s3cret\xed\xa0\x80"):
        r = s.raw(b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + value + b"\r\n\r\n")
        assert r.status == 401 and r.json()["type"] == "Unauthorized", (value, r.status, r.body)
    ok = s.raw(b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n\r\n")
    assert ok.status == 200


@pytest.mark.parametrize(
    "path", ["/nope", "/v1/chunks", "/v1/chunks/", "/v2/chunks/" + "a" * 32, "/v1/batch"]
)
def test_unknown_route(srv, path):
    before = srv.usage()
    assert_rejected(srv, srv.request("GET", path), 404, "NotFound", before)


@pytest.mark.parametrize(
    "method,path",
    [("POST", wire.chunk_path(key(0))), ("PATCH", wire.chunk_path(key(0))), ("GET", wire.BATCH_PUT_PATH),
     ("PUT", wire.LOOKUP_PATH), ("DELETE", "/healthz"), ("POST", "/metrics")],
)  # fmt: skip
def test_wrong_method(srv, method, path):
    before = srv.usage()
    r = srv.request(method, path, make_blob(1))
    assert_rejected(srv, r, 405, "MethodNotAllowed", before)
    assert "allow" in r.headers


@pytest.mark.parametrize(
    "raw",
    [b"GARBAGE\r\n\r\n", b"GET /v1/chunks/" + b"a" * 32 + b" HTTP/9.9\r\n\r\n", b"PUT /x HTTP/1.1\r\nHost x\r\n\r\n",
     b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"],
    ids=["not-http", "bad-version", "bad-header", "huge-line"],
)  # fmt: skip
def test_unparsable_http(srv, raw):
    before = srv.usage()
    r = srv.raw(raw)
    assert 400 <= r.status < 500
    assert_rejected(srv, r, r.status, "InvalidArgument", before)


def test_server_survives_all_of_it(srv):
    """After the abuse above (each test has its own server, so abuse this one too), it still serves."""
    for raw in (b"\x00\x01\x02\r\n\r\n", b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
        assert 400 <= srv.raw(raw).status < 500
    assert srv.request("PUT", wire.chunk_path(key(5)), make_blob(5)).status == 201
    assert srv.request("GET", wire.chunk_path(key(5))).body == kept(make_blob(5), key(5))
