"""Server fixtures: in-process servers on free ports (always stopped), blobs, raw HTTP helpers."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread, open_store

from kvstore.blob import encode_blob
from kvstore.clock import SYSTEM, Clock
from kvstore.config import StoreConfig
from kvstore.protocol import wire
from kvstore.store import TieredStore
from tests.waiting import wait_until


def make_blob(seed: int = 0, tokens: int = 16, key: str | None = None) -> bytes:
    """A test blob of `seed`'s KV; bound to `key` when given (the bytes the store keeps, and serves,
    unchanged), else bound to no key (the store keeps it bound to the key it is put under:
    tests.blobs.kept)."""
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, tokens, 2, 8, generator=g).half(), key=key)


def key(i: int) -> str:
    return f"{i:032x}"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds."""
    wait_until(cond, timeout, interval=0.01)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def read_response(sock: socket.socket, head_only: bool = False) -> RawResponse:
    """Parse one HTTP/1.1 response from a raw socket (Content-Length bodies only)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = 0 if head_only else int(headers.get("content-length", 0))
    while len(body) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(status, headers, body[:n])


def route_content_type(path: str) -> str:
    """The Content-Type a data route takes for its body."""
    if path.startswith(wire.CHUNKS_PATH):
        return wire.BLOB_CONTENT_TYPE
    return wire.BATCH_CONTENT_TYPE if path == wire.BATCH_PUT_PATH else wire.JSON_CONTENT_TYPE


class Server:
    """A running in-process server and the store behind it."""

    def __init__(self, thread: ServerThread, store: TieredStore) -> None:
        self.thread = thread
        self.store = store
        self.url = thread.url
        self.port = thread.server.port
        assert self.port is not None

    def raw(self, payload: bytes, timeout: float = 10.0, head_only: bool = False) -> RawResponse:
        """Send bytes as they are on a fresh connection and read one response."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(payload)
            return read_response(s, head_only)

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> RawResponse:
        """One request; a body goes with its route's Content-Type unless `headers` name one."""
        headers = dict(headers or {})
        if method in ("PUT", "POST") and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = route_content_type(path)
        lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return self.raw(("\r\n".join(lines) + "\r\n\r\n").encode() + body, head_only=method == "HEAD")

    def usage(self) -> tuple[int, int]:
        """(keys, bytes) over every tier: what 'the store is unchanged' compares."""
        return sum(len(t) for t in self.store.tiers), sum(t.usage() for t in self.store.tiers)


@pytest.fixture
def server_factory(tmp_path) -> Iterator[Callable[..., Server]]:
    """Start servers with any StoreConfig / ServerConfig fields (and the store's clock); every one is
    stopped afterwards."""
    started: list[Server] = []

    def start(store: dict | None = None, clock: Clock = SYSTEM, **server_fields: Any) -> Server:
        fields = {"tiers": ["cpu"], "cpu_capacity": "64MiB", "disk_path": tmp_path / "disk"}
        fields.update(store or {})
        store_config = StoreConfig(**fields)
        config = ServerConfig(**{"port": 0, "sample_interval": 0.2, **server_fields})
        # as kvstore-server builds it (the cpu arena: shm on); `clock`: a ManualClock steps its TTLs
        tiered = open_store(store_config, config, clock)
        thread = ServerThread(tiered, store_config, config, close_store=True).start()
        srv = Server(thread, tiered)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.thread.stop()


@pytest.fixture
def server(server_factory) -> Server:
    return server_factory()
