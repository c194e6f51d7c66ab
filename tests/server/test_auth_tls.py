"""Bearer-token auth (constant-time compare, 401 JSON + WWW-Authenticate) and TLS."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess

import pytest
from kvstore.sdk.remote import RemoteBackend
from kvstore.sdk.store import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import warn_if_open

from kvstore.errors import ConfigError, Unauthorized, Unavailable
from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob, read_response

TOKEN = "s3cret-token"


@pytest.fixture
def secured(server_factory):
    return server_factory(auth_token=TOKEN)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    "method,path",
    [("GET", wire.chunk_path(key(1))), ("PUT", wire.chunk_path(key(1))), ("HEAD", wire.chunk_path(key(1))),
     ("DELETE", wire.chunk_path(key(1))), ("POST", wire.BATCH_GET_PATH), ("POST", wire.BATCH_PUT_PATH),
     ("POST", wire.BATCH_EXISTS_PATH), ("POST", wire.LOOKUP_PATH), ("GET", wire.STATS_PATH),
     ("GET", wire.HISTORY_PATH), ("GET", "/metrics"), ("GET", "/no/such/route")],
)  # fmt: skip
@pytest.mark.parametrize(
    "headers", [{}, _auth("wrong"), _auth(TOKEN + "x"), {"Authorization": TOKEN}], ids=str
)
def test_every_protected_route_needs_the_token(secured, method, path, headers):
    before = secured.usage()
    r = secured.request(method, path, make_blob(1) if method == "PUT" else b"", headers)
    assert r.status == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    if method != "HEAD":
        assert r.json()["type"] == "Unauthorized"
    assert secured.usage() == before


def test_the_right_token_opens_everything(secured):
    h = _auth(TOKEN)
    assert secured.request("PUT", wire.chunk_path(key(1)), make_blob(1), h).status == 201
    assert secured.request("GET", wire.chunk_path(key(1)), headers=h).body == kept(make_blob(1), key(1))
    assert secured.request("GET", "/metrics", headers=h).status == 200
    assert secured.request("GET", wire.STATS_PATH, headers=h).json()["tiers"][0]["keys"] == 1


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR", "Bearer "])
def test_the_auth_scheme_is_case_insensitive(secured, scheme):
    """Issue 30 #12, RFC 9110 section 11.1: `bearer x` is `Bearer x` (one or more spaces after it)."""
    h = {"Authorization": f"{scheme} {TOKEN}"}
    assert secured.request("GET", wire.STATS_PATH, headers=h).status == 200
    for wrong in (f"{scheme} {TOKEN}x", f"Basic {TOKEN}", f"{scheme.strip()}{TOKEN}", f"bearerx {TOKEN}"):
        assert secured.request("GET", wire.STATS_PATH, headers={"Authorization": wrong}).status == 401


def test_without_the_token_no_body_is_reserved(server_factory):
    """Issue 30 #9 on HTTP: puts declaring big bodies and no token are a 401 from their headers and
    reserve nothing of the body budget; an authenticated put still fits."""
    srv = server_factory(auth_token=TOKEN, max_body_bytes_in_flight=64 << 20)
    head = (
        f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {wire.BLOB_CONTENT_TYPE}\r\n"
        f"Content-Length: {32 << 20}\r\n\r\n"
    ).encode()
    hogs = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(16)]
    try:
        for s in hogs:
            s.sendall(head)  # and no body
        for s in hogs:
            assert read_response(s).status == 401
        assert srv.thread.state.budget.used == 0
        r = srv.request("PUT", wire.chunk_path(key(2)), make_blob(2, tokens=8000), _auth(TOKEN))
        assert r.status == 201
    finally:
        for s in hogs:
            s.close()


@pytest.mark.parametrize(
    "host,token,warned",
    [("0.0.0.0", None, True), ("::", None, True), ("", None, True), ("10.1.2.3", None, True),
     ("kvstore.example", None, True), ("0.0.0.0", TOKEN, False), ("127.0.0.1", None, False),
     ("::1", None, False), ("localhost", None, False), ("127.0.0.2", None, False)],
)  # fmt: skip
def test_listening_beyond_this_host_without_a_token_warns(host, token, warned, caplog):
    """Issue 30 #12: `--host 0.0.0.0` without a token started silently; now a WARNING says so (the
    server calls this as it starts; nothing here binds anything but loopback)."""
    caplog.set_level(logging.WARNING, logger="kvstore.server.runner")
    assert warn_if_open(ServerConfig(host=host, auth_token=token)) is warned
    text = caplog.text
    assert ("WITHOUT A TOKEN" in text) is warned and (token is None or token not in text)
    if warned:
        assert caplog.records[0].levelname == "WARNING"


def test_open_routes(secured):
    assert secured.request("GET", "/healthz").status == 200
    r = secured.request("GET", "/dashboard")  # the page holds no data; it asks for the token itself
    assert r.status == 200 and b"#token=" in r.body


def test_metrics_can_be_left_open(server_factory):
    srv = server_factory(auth_token=TOKEN, metrics_auth=False)
    assert srv.request("GET", "/metrics").status == 200
    assert srv.request("GET", wire.STATS_PATH).status == 401


def test_token_file(server_factory, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    srv = server_factory(auth_token_file=path)
    assert srv.request("GET", wire.STATS_PATH).status == 401
    assert srv.request("GET", wire.STATS_PATH, headers=_auth(TOKEN)).status == 200
    path.write_text("   \n")
    with pytest.raises(ConfigError):
        ServerConfig(auth_token_file=path).token()
    with pytest.raises(ConfigError):
        ServerConfig(auth_token="a", auth_token_file=path)


async def test_sdk_gets_typed_unauthorized(secured):
    k = key(1)
    anonymous = Store.connect(secured.url, retries=0)
    with pytest.raises(Unauthorized):
        anonymous.get(k)
    with pytest.raises(Unauthorized):
        anonymous.put(k, make_blob(1, tokens=4096))  # 256 KiB body: the 401 arrives while it is being sent
    with pytest.raises(Unauthorized):
        await anonymous.aexists(k)
    await anonymous.aclose()
    with Store.connect(secured.url, token=TOKEN) as good:
        good.put(k, make_blob(1, key=k))  # bound to its key: kept as it is
        assert bytes(good.get_blob(k)) == make_blob(1, key=k)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
         "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return d / "cert.pem", d / "key.pem"


async def test_tls(server_factory, cert):
    cert_path, key_path = cert
    srv = server_factory(tls_cert=cert_path, tls_key=key_path, auth_token=TOKEN)
    assert srv.url.startswith("https://")
    with Store.connect(srv.url, token=TOKEN, verify_tls=str(cert_path)) as s:
        s.put(key(1), make_blob(1, key=key(1)))  # bound to its key: kept as it is
        assert bytes(s.get_blob(key(1))) == make_blob(1, key=key(1))
        assert s.batch_exists([key(1), key(2)]) == [True, False]
    s = Store.connect(srv.url, token=TOKEN, verify_tls=str(cert_path))
    assert await s.aexists(key(1))
    await s.aclose()
    with pytest.raises(Unavailable):  # an unknown certificate is refused
        RemoteBackend(srv.url, token=TOKEN, retries=0).get_blob(key(1))
    plain = f"http://127.0.0.1:{srv.port}"
    with pytest.raises(Unavailable):  # plain HTTP to the TLS port
        RemoteBackend(plain, token=TOKEN, retries=0, timeout=3).get_blob(key(1))
    with pytest.raises(ConfigError):
        ServerConfig(tls_cert=cert_path)
