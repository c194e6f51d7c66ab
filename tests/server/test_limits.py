"""Slow and abusive clients cost the server a bounded amount: headers have a deadline, idle
connections a timeout, connections a limit (refused fast, with a 503), request bodies a budget of
bytes in flight (503 + Retry-After beyond it); and at a real file-descriptor limit a stored blob is
never a 404 and a lost write never a 201."""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob, read_response
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def _closed(sock: socket.socket, within: float) -> bytes:
    """What the server sent before closing `sock` (fails if it stays open longer than `within`)."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open over {within} s; it sent {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data


def _open_connections(srv) -> int:  # noqa: ANN001 (tests.server.conftest.Server)
    """The client connections the in-process server holds (kvstore_http_connections, read in place:
    a scrape would be one more connection)."""
    return srv.thread.state.metrics.connections()


def _scraped_connections(request: Callable[[str, str], tuple[int, bytes]]) -> int:
    status, body = request("GET", "/metrics")
    return (
        int(float(re.search(rb"^kvstore_http_connections (\S+)$", body, re.M).group(1)))
        if status == 200
        else 99
    )


def test_headers_that_dribble_in_get_a_408_and_the_connection_closes(server_factory):
    srv = server_factory(header_timeout=0.5)
    socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
    for s in socks:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and never the end
    start = time.monotonic()
    answers = [_closed(s, within=5) for s in socks]
    assert time.monotonic() - start < 5
    for data in answers:
        assert data.startswith(b"HTTP/1.1 408"), data[:100]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["type"] == "InvalidArgument"
    for s in socks:
        s.close()
    assert srv.request("GET", "/healthz").status == 200  # and it serves everyone else meanwhile


def test_headers_sent_a_byte_at_a_time_within_the_deadline_are_served(server_factory):
    srv = server_factory(header_timeout=2.0)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        for b in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n":
            s.sendall(bytes([b]))
            time.sleep(0.01)
        assert read_response(s).status == 200


def test_idle_connections_are_closed_after_the_keepalive_timeout(server_factory):
    srv = server_factory(keepalive_timeout=0.5)
    silent = socket.create_connection(("127.0.0.1", srv.port))  # connects, never sends a byte
    assert _closed(silent, within=5) == b""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
        assert read_response(s).status == 200
        assert _closed(s, within=5) == b""  # idle after its request: closed too
    silent.close()


def test_connections_over_the_limit_are_refused_fast(server_factory):
    srv = server_factory(max_connections=5, keepalive_timeout=60)
    srv.request("PUT", wire.chunk_path(key(1)), make_blob(1))
    hogs = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(5)]
    wait_until(lambda: _open_connections(srv) == 5)  # the server holds all five
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
        data = _closed(extra, within=5)
    assert time.monotonic() - start < 2
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
    assert json.loads(body)["type"] == "Busy"
    for h in hogs:
        h.close()
    wait_until(lambda: _open_connections(srv) == 0)
    assert srv.request("GET", wire.chunk_path(key(1))).body == kept(make_blob(1), key(1))  # room again
    metrics = srv.request("GET", "/metrics").body.decode()
    assert "kvstore_http_refused_connections_total 1.0" in metrics


def _slow_put(port: int, k: str, blob: bytes, sent: threading.Event, go: threading.Event) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"PUT {wire.chunk_path(k)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {wire.BLOB_CONTENT_TYPE}\r\n"
            f"Content-Length: {len(blob)}\r\n\r\n".encode()
            + blob[: len(blob) // 2]
        )
        sent.set()
        go.wait(30)
        s.sendall(blob[len(blob) // 2 :])
        return read_response(s).status


def test_request_bodies_in_flight_have_a_budget(server_factory):
    srv = server_factory(max_body_bytes_in_flight=2 << 20)  # 2 MiB; "large" is over 256 KiB
    big = make_blob(1, tokens=8000)  # ~1000 KiB, reserved while read (into one buffer)
    sent, go = threading.Event(), threading.Event()
    result: list[int] = []
    slow = threading.Thread(target=lambda: result.append(_slow_put(srv.port, key(1), big, sent, go)))
    slow.start()
    try:
        assert sent.wait(10)
        wait_until(lambda: srv.thread.state.budget.used >= len(big))  # reserved while the rest trickles in
        before = srv.usage()
        r = srv.request("PUT", wire.chunk_path(key(2)), make_blob(2, tokens=8000))
        assert r.status == 503 and r.headers["retry-after"] == "1" and r.json()["type"] == "Busy"
        assert srv.usage() == before  # refused before its body was read; nothing stored
        small = srv.request("PUT", wire.chunk_path(key(3)), make_blob(3))  # small bodies still fit
        assert small.status == 201
        too_big = make_blob(4, tokens=17000)  # 2.1 MiB: over the whole budget, never fits
        assert srv.request("PUT", wire.chunk_path(key(4)), too_big).status == 413
        assert "kvstore_http_body_bytes_in_flight" in srv.request("GET", "/metrics").body.decode()
    finally:
        go.set()
        slow.join(30)
    assert result == [201]
    assert srv.thread.state.budget.used == 0  # every reservation returned
    assert srv.request("PUT", wire.chunk_path(key(2)), make_blob(2, tokens=8000)).status == 201


_FD_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from kvstore.server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_at_a_real_fd_limit_no_stored_blob_is_a_404_and_no_lost_write_a_201(tmp_path: Path):
    """The server runs with RLIMIT_NOFILE 128 and a disk tier; 300 idle connections try to take every
    descriptor while a client writes and reads. Each answer is right or a 503, never a wrong one."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 400:
        pytest.skip("the test process needs 400 file descriptors for its hog connections")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _FD_SERVER, "--tiers", "disk", "--disk-path", str(tmp_path), "--port", "0",
         "--log-level", "WARNING"],  # fmt: skip
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    hogs: list[socket.socket] = []
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, line
        port = int(line.rsplit(":", 1)[1])

        def request(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
            head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {wire.BLOB_CONTENT_TYPE}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
            with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                s.sendall(head.encode() + body)
                r = read_response(s)
                return r.status, r.body

        stored = list(range(50, 60))
        for i in stored:
            assert request("PUT", wire.chunk_path(key(i)), make_blob(i))[0] == 201
        for _ in range(300):
            try:
                hogs.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
            if len(hogs) % 10 == 0:  # and the stored blobs are read all along, at every fd count
                for i in stored:
                    try:
                        status, body = request("GET", wire.chunk_path(key(i)))
                    except OSError:
                        continue  # not answered at all (nothing claimed)
                    assert status in (200, 503), (len(hogs), i, status, body[:200])
                    assert status != 200 or body == kept(make_blob(i), key(i))
        acked, statuses = [], []
        for i in range(40):
            try:
                status, _ = request("PUT", wire.chunk_path(key(i)), make_blob(i))
            except OSError:
                continue  # refused at the socket: nothing was claimed
            statuses.append(status)
            assert status in (201, 503), status
            if status == 201:
                acked.append(i)
        for i in acked:
            status, body = request("GET", wire.chunk_path(key(i)))
            assert status in (200, 503), (i, status)
            if status == 200:
                assert body == kept(make_blob(i), key(i))
        for h in hogs:
            h.close()
        hogs = []
        wait_until(lambda: _scraped_connections(request) <= 1)  # the server saw them go (1: the scrape)
        for i in acked + stored:  # with the hogs gone, every acknowledged blob is there
            assert request("GET", wire.chunk_path(key(i))) == (200, kept(make_blob(i), key(i)))
        for i in range(40, 45):
            assert request("PUT", wire.chunk_path(key(i)), make_blob(i))[0] == 201
        assert 503 in statuses  # the hogs did take every slot meanwhile
    finally:
        for h in hogs:
            h.close()
        proc.terminate()
        proc.wait(30)


def test_slow_readers_hold_the_budget_only_until_the_body_timeout(server_factory):
    """A large response pins its blob until it is read (even once the tier evicted it): it is charged
    to the same budget, and a client that does not read it within body_timeout is cut off."""
    srv = server_factory(max_body_bytes_in_flight=64 << 20, body_timeout=1.0)  # large ones share 48 MiB
    blob = make_blob(
        1, tokens=131_072, key=key(1)
    )  # 16 MiB: more than loopback's socket buffers take at once
    assert srv.request("PUT", wire.chunk_path(key(1)), blob).status == 201
    readers = []
    for _ in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.sendall(f"GET {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        readers.append(s)  # and never read
    budget = srv.thread.state.budget  # the readers' answers pinned, in flight: no room for one more
    wait_until(lambda: budget.used_large + len(blob) > budget.limit * 3 // 4)
    r = srv.request("GET", wire.chunk_path(key(1)))  # this one must wait
    assert r.status == 503 and r.json()["type"] == "Busy" and r.headers["retry-after"] == "1"
    # past body_timeout (1 s, aiohttp's on a real socket): the slow readers are dropped, their budget returned
    wait_until(lambda: srv.thread.state.budget.used == 0, timeout=5)
    got = srv.request("GET", wire.chunk_path(key(1)))
    assert got.status == 200 and got.body == blob
    for s in readers:
        s.close()
