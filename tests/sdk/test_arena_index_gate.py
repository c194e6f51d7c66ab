"""The arena index's TSO gate (`usable_here`): off x86-64 the server does not offer the table in HELLO
and a client does not read one it is offered; the gate is the platform probe, patched here."""

from __future__ import annotations

import platform

import pytest
from kvstore.sdk.remote import RemoteBackend

from kvstore.protocol import dataplane as dp
from kvstore.protocol import shm
from kvstore.protocol.arena_table import usable_here
from tests.sdk.test_arena_index import answer, raw_plane, send
from tests.server.conftest import key, make_blob

needs_shm = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc")


@pytest.mark.parametrize(
    "machine, usable",
    [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False), ("ppc64le", False)],
)
def test_the_gate_is_the_platform(monkeypatch, machine: str, usable: bool) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert usable_here() is usable


def hello(port: int) -> dict:
    sock = raw_plane(port)
    try:
        send(sock, dp.HELLO, {"v": dp.VERSION})
        head, meta = answer(sock)
        assert head.status == 200, meta
        return meta
    finally:
        sock.close()


@needs_shm
def test_a_server_off_x86_does_not_offer_the_index(server, monkeypatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    offered = hello(server.port)
    assert "arena" in offered and len(offered["index"]) == 5
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    refused = hello(server.port)
    assert "arena" in refused and "index" not in refused  # the arena is still lent, its table is not


@needs_shm
def test_a_client_off_x86_does_not_read_an_offered_index(server, monkeypatch) -> None:
    monkeypatch.setattr("kvstore.server.dataplane_ops.usable_here", lambda: True)  # the server offers it
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # the client's probe says no
    be = RemoteBackend(server.url, transport="shm")
    try:
        blob = make_blob(1, tokens=4096, key=key(1))
        be.put_blob(key(1), blob)
        assert bytes(be.get_blob(key(1))) == blob and bytes(be.get_blob(key(1))) == blob
        assert be.counts["index"] == 0 and be.counts["shm"] >= 2  # asked the server each time
        assert (
            be.plane.segment is not None
            and be.plane.segment.arena is not None
            and be.plane.segment.arena.index is None
        )
    finally:
        be.close()
