"""A web page in a browser on the server's host must not poison or wipe the cache: data routes take
only their own content type (or the X-KVStore-Wire header), a token-less server refuses Host and
Origin headers naming other sites (DNS rebinding), and no response grants CORS."""

from __future__ import annotations

import json

import pytest

from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob, route_content_type

EVIL = "http://evil.example"
# what a page may send cross-origin without a preflight: a "simple" Content-Type, or none at all
SIMPLE_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x", None]  # fmt: skip


def _routes() -> list[tuple[str, str, bytes]]:
    keys = json.dumps({"keys": [key(0)]}).encode()
    frame = b"".join(wire.encode_frame([key(0)], [make_blob(9)]))
    return [
        ("POST", wire.BATCH_PUT_PATH, frame),
        ("POST", wire.BATCH_DELETE_PATH, keys),
        ("POST", wire.BATCH_GET_PATH, keys),
        ("POST", wire.BATCH_EXISTS_PATH, keys),
        ("POST", wire.LOOKUP_PATH, keys),
        ("PUT", wire.chunk_path(key(0)), make_blob(9)),
    ]


@pytest.fixture
def srv(server_factory):
    s = server_factory()
    assert s.request("PUT", wire.chunk_path(key(0)), make_blob(0)).status == 201
    return s


def _headers(content_type: str | None, **extra: str) -> dict[str, str]:
    h = {"Content-Type": content_type} if content_type else {}
    return {**h, **extra}


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
@pytest.mark.parametrize("method,path,body", _routes(), ids=lambda v: v if isinstance(v, str) else "")
def test_data_routes_refuse_a_body_a_browser_could_send_cross_origin(srv, method, path, body, content_type):
    before = srv.usage()
    raw = srv.raw(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Length: {len(body)}\r\n".encode()
        + (f"Content-Type: {content_type}\r\n".encode() if content_type else b"")
        + b"\r\n"
        + body
    )
    assert raw.status == 415, raw.body
    assert raw.json()["type"] == "UnsupportedMediaType" and wire.WIRE_VERSION_HEADER in raw.json()["error"]
    assert srv.usage() == before
    assert srv.request("GET", wire.chunk_path(key(0))).body == kept(make_blob(0), key(0))


def test_the_wire_header_stands_for_the_content_type(srv):
    """A custom header forces a preflight just as the binary types do, so it is accepted instead."""
    r = srv.request(
        "POST",
        wire.BATCH_DELETE_PATH,
        json.dumps({"keys": [key(0)]}).encode(),
        {"Content-Type": "text/plain", wire.WIRE_VERSION_HEADER: "1"},
    )
    assert r.status == 200 and r.json() == {"deleted": 1}


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8100", "kvstore.attacker.test", "127.0.0.1.nip.io"]
)
def test_without_a_token_a_foreign_host_is_refused(srv, host):
    """DNS rebinding: the page's own name resolves to 127.0.0.1, so the browser calls it same-origin."""
    before = srv.usage()
    for method, path, body in [*_routes(), ("GET", wire.chunk_path(key(0)), b""), ("GET", "/v1/stats", b""),
                               ("GET", "/metrics", b""), ("DELETE", wire.chunk_path(key(0)), b"")]:  # fmt: skip
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        if body:
            lines.append(f"Content-Type: {route_content_type(path)}")
        r = srv.raw(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        assert r.status == 403, (method, path, r.status, r.body)
        assert r.json()["type"] == "Forbidden"
    assert srv.usage() == before


def test_without_a_token_a_foreign_origin_is_refused(srv):
    r = srv.request("POST", wire.BATCH_DELETE_PATH, json.dumps({"keys": [key(0)]}).encode(), {"Origin": EVIL})
    assert r.status == 403 and r.json()["type"] == "Forbidden"
    r = srv.request("GET", "/v1/stats", headers={"Origin": "null"})  # sandboxed frames, file:// pages
    assert r.status == 403
    r = srv.request("GET", "/v1/stats", headers={"Origin": "http://203.0.113.9"})  # a page on a public IP
    assert r.status == 403
    r = srv.request("GET", "/v1/stats", headers={"Origin": f"http://127.0.0.1:{srv.port}"})  # the dashboard
    assert r.status == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:1", "localhost", "LOCALHOST:8100", "[::1]:8100",
                                  "10.1.2.3:8100", "app.localhost"])  # fmt: skip
def test_without_a_token_ip_and_localhost_hosts_are_served(srv, host):
    r = srv.raw(
        f"GET {wire.chunk_path(key(0))} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n".encode()
    )
    assert r.status == 200 and r.body == kept(make_blob(0), key(0))


def test_allowed_hosts_and_tokens(server_factory):
    named = server_factory(allowed_hosts=["kvstore.internal"])
    req = f"GET /v1/stats HTTP/1.1\r\nHost: {{}}:{named.port}\r\nContent-Length: 0\r\n\r\n"
    assert named.raw(req.format("kvstore.internal").encode()).status == 200
    assert named.raw(req.format("kvstore.internal.").encode()).status == 200
    assert named.raw(req.format("other.internal").encode()).status == 403
    anyhost = server_factory(allowed_hosts="*")
    assert anyhost.raw(req.format("whatever.example").encode()).status == 200
    # with a token the page has no credentials to send: Host is not checked, the token is
    tok = server_factory(auth_token="s3cret")
    req = "GET /v1/stats HTTP/1.1\r\nHost: evil.example\r\nContent-Length: 0\r\n{}\r\n"
    assert tok.raw(req.format("Authorization: Bearer s3cret\r\n").encode()).status == 200
    assert tok.raw(req.format("").encode()).status == 401


def test_no_response_grants_cors(srv):
    preflight = srv.request(
        "OPTIONS",
        wire.BATCH_PUT_PATH,
        headers={"Origin": f"http://127.0.0.1:{srv.port}", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"},
    )  # fmt: skip
    assert 400 <= preflight.status < 500 and preflight.json()["error"]
    responses = [
        preflight,
        srv.request("GET", wire.chunk_path(key(0)), headers={"Origin": f"http://localhost:{srv.port}"}),
    ]
    for r in responses:
        assert not [h for h in r.headers if h.startswith("access-control-")], r.headers
