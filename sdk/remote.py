"""`RemoteBackend`: the Backend protocol over the kvstore-server HTTP API (DESIGN.md, Spec 6).

Sync calls use a lean HTTP/1.1 client on raw sockets: a keep-alive pool, TCP_NODELAY, blobs sent with
`sendall` straight from the caller's buffer and bodies received with `recv_into` one preallocated
buffer (no per-chunk copies, no http.client line parsing of large bodies). Async calls use an aiohttp
session. Every call is retried with exponential backoff on connection errors and 502/503/504: all of
them are idempotent (a blob's key names its content, so re-putting it is harmless). Errors arrive as
the `kvstore.errors` type the server named in its JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvstore import wire
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.keys import validate_key

log = logging.getLogger(__name__)
Blob = bytes | bytearray | memoryview
RETRY_STATUSES = frozenset({502, 503, 504})
_SMALL = 64 * 1024  # bodies up to this size are sent in one write with the headers


class BufferPool:
    """Receive buffers that are reused once nobody holds them any more.

    A fresh 1 MiB buffer costs its page faults on every response (measured: it halves loopback
    throughput). A pooled bytearray is handed out again only when the pool's own reference is the last
    one: a caller still holding the blob (or any memoryview slice of it) keeps it out of reuse, so a
    returned blob is never overwritten under its holder."""

    def __init__(self, max_bytes: int = 256 * 2**20, max_buffers: int = 64) -> None:
        self.max_bytes, self.max_buffers = max_bytes, max_buffers
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        with self._lock:
            for buf in self._buffers:
                # 3 references: the pool's list, the loop variable and getrefcount's argument
                if n <= len(buf) <= 2 * n and sys.getrefcount(buf) <= 3:
                    return memoryview(buf)[:n]
            buf = bytearray(n)
            if n >= _SMALL and len(self._buffers) < self.max_buffers:
                if sum(len(b) for b in self._buffers) + n <= self.max_bytes:
                    self._buffers.append(buf)
            return memoryview(buf)


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytearray | memoryview) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(bytes(self.body))


class _Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        connect_timeout: float,
        tls: ssl.SSLContext | None,
        pool: BufferPool,
    ) -> None:
        self.pool = pool
        sock = socket.create_connection((host, port), timeout=connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.settimeout(timeout)
        self.sock = sock
        self.pending = bytearray()  # bytes received past the end of the last response (none normally)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, head: bytes, body: Sequence[Blob]) -> None:
        total = sum(memoryview(b).nbytes for b in body)
        if total <= _SMALL:
            self.sock.sendall(b"".join([head, *body]))
            return
        self.sock.sendall(head)
        for part in body:
            self.sock.sendall(part)

    def _fill(self) -> None:
        # Small reads while looking for the end of the headers: the body then lands in its own buffer
        # through recv_into, instead of being copied out of this one.
        data = self.sock.recv(16 * 1024)
        if not data:
            raise ConnectionError("server closed the connection")
        self.pending += data

    def receive(self, head_only: bool) -> tuple[Response, bool]:
        """The next response, and whether the connection may be reused."""
        while (end := self.pending.find(b"\r\n\r\n")) < 0:
            if len(self.pending) > 1 << 16:
                raise InvalidArgument("response headers over 64 KiB")
            self._fill()
        lines = bytes(self.pending[:end]).decode("latin-1").split("\r\n")
        del self.pending[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ConnectionError(f"not an HTTP response: {lines[0]!r:.80}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        if head_only or status in (204, 304):
            return Response(status, headers, bytearray()), keep
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return Response(status, headers, self._read_chunked()), keep
        if "content-length" not in headers:  # body runs until the server closes
            while True:
                try:
                    self._fill()
                except ConnectionError:
                    body, self.pending = self.pending, bytearray()
                    return Response(status, headers, body), False
        return Response(status, headers, self._read_exact(int(headers["content-length"]))), keep

    def _read_exact(self, n: int) -> memoryview:
        view = body = self.pool.take(n)
        got = min(n, len(self.pending))
        view[:got] = self.pending[:got]
        del self.pending[:got]
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError(f"server closed the connection after {got} of {n} body bytes")
            got += r
        return body

    def _read_chunked(self) -> bytearray:
        body = bytearray()
        while True:
            while (end := self.pending.find(b"\r\n")) < 0:
                self._fill()
            size = int(bytes(self.pending[:end]).split(b";")[0], 16)
            del self.pending[: end + 2]
            chunk = bytes(self._read_exact(size + 2))
            if size == 0:
                return body
            body += chunk[:size]


class RemoteBackend:
    """Talks to a kvstore-server. Thread-safe (a pool of connections); one aiohttp session for async."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        retries: int = 3,
        backoff: float = 0.05,
        pool_size: int = 16,
        verify_tls: bool | str = True,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"server URL must be http(s)://host[:port], got {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.retries, self.backoff, self.pool_size = retries, backoff, pool_size
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._tls = ssl.create_default_context(cafile=verify_tls if isinstance(verify_tls, str) else None)
            if verify_tls is False:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE
        host_header = self.host if ":" not in self.host else f"[{self.host}]"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._common = (
            f"Host: {host_header}:{self.port}\r\n{auth}{wire.WIRE_VERSION_HEADER}: {wire.WIRE_VERSION}\r\n"
        )
        self._token = token
        self._idle: list[_Connection] = []
        self._buffers = BufferPool()
        self._lock = threading.Lock()
        self._session: Any = None  # aiohttp.ClientSession, created on first async call
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- sync transport ------------------------------------------------------------------------------

    def _connect(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Connection(self.host, self.port, self.timeout, self.connect_timeout, self._tls, self._buffers)

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def request(
        self, method: str, path: str, body: Sequence[Blob] = (), content_type: str = wire.BLOB_CONTENT_TYPE
    ) -> Response:
        """One HTTP exchange, retried on connection errors and 502/503/504; raises on any other >= 400
        except a 404 from a chunk route, which the caller turns into None / False."""
        if self._closed:
            raise InvalidArgument("this RemoteBackend is closed")
        length = sum(memoryview(b).nbytes for b in body)
        head = (
            f"{method} {path} HTTP/1.1\r\n{self._common}Content-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()
        for attempt in range(self.retries + 1):
            conn = None
            try:
                conn = self._connect()
                try:
                    conn.send(head, body)
                except OSError:
                    pass  # the server may have answered early (401, 413) and closed: read that answer
                resp, keep = conn.receive(head_only=method == "HEAD")
                if keep:
                    self._release(conn)
                else:
                    conn.close()
                conn = None
            except (OSError, ConnectionError) as e:
                if conn is not None:
                    conn.close()
                if attempt == self.retries:
                    raise Unavailable(f"{method} {self.url}{path} failed: {e}") from None
                time.sleep(self.backoff * 2**attempt)
                continue
            if resp.status in RETRY_STATUSES and attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
                continue
            if resp.status >= 400 and not (resp.status == 404 and path.startswith(wire.CHUNKS_PATH)):
                raise wire.error_from_response(resp.status, bytes(resp.body))
            return resp
        raise AssertionError("unreachable")

    def _keys_request(self, path: str, keys: Sequence[str]) -> Response:
        for key in keys:
            validate_key(key)
        payload = json.dumps({"keys": list(keys)}).encode()
        return self.request("POST", path, [payload], wire.JSON_CONTENT_TYPE)

    # -- sync API --------------------------------------------------------------------------------------

    def get_blob(self, key: str) -> Blob | None:
        resp = self.request("GET", wire.chunk_path(validate_key(key)))
        return None if resp.status == 404 else resp.body

    def put_blob(self, key: str, blob: Blob) -> list[str]:
        resp = self.request("PUT", wire.chunk_path(validate_key(key)), [blob])
        return _tiers(resp.headers.get(wire.STORED_IN_HEADER.lower()))

    def exists(self, key: str) -> bool:
        return self.request("HEAD", wire.chunk_path(validate_key(key))).status == 200

    def delete(self, key: str) -> bool:
        return self.request("DELETE", wire.chunk_path(validate_key(key))).status != 404

    def batch_get(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> list[Blob | None]:
        if not keys:
            return []
        resp = self._keys_request(wire.BATCH_GET_PATH, keys)
        got_keys, blobs = wire.decode_frame(resp.body, allow_missing=True)
        if got_keys != list(keys):
            raise InvalidArgument("server answered a batch get with other keys than asked")
        if reasons is not None:
            reasons[:] = _miss_reasons(resp.body, blobs)
        return blobs

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]:
        if not items:
            return []
        keys = [validate_key(k) for k, _ in items]
        resp = self.request(
            "POST",
            wire.BATCH_PUT_PATH,
            wire.encode_frame(keys, [b for _, b in items]),
            wire.BATCH_CONTENT_TYPE,
        )
        return resp.json()["stored_in"]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in self._keys_request(wire.BATCH_EXISTS_PATH, keys).json()["exists"]]

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        if not keys:
            return 0, None
        return _lookup_answer(self._keys_request(wire.LOOKUP_PATH, keys).json())

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.lookup(keys)[0]

    def stats(self) -> dict[str, Any]:
        return self.request("GET", wire.STATS_PATH).json()

    def health(self) -> bool:
        try:
            return self.request("GET", "/healthz").status == 200
        except KVStoreError:
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- async -------------------------------------------------------------------------------------------

    async def _arequest(
        self, method: str, path: str, data: Any = None, content_type: str = wire.BLOB_CONTENT_TYPE
    ) -> tuple[int, bytes]:
        status, _, body = await self._arequest_headers(method, path, data, content_type)
        return status, body

    async def _arequest_headers(
        self, method: str, path: str, data: Any = None, content_type: str = wire.BLOB_CONTENT_TYPE
    ) -> tuple[int, Any, bytes]:
        import aiohttp  # noqa: PLC0415 (only async users pay for it)

        loop = asyncio.get_running_loop()
        if self._session is not None and self._session_loop is not loop:
            self._session = None  # a session belongs to one event loop; this is a new one (asyncio.run again)
        if self._session is None or self._session.closed:
            self._session_loop = loop
            ssl_arg: Any = self._tls if self._tls is not None else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.pool_size, ssl=ssl_arg),
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout),
            )
        headers = {wire.WIRE_VERSION_HEADER: wire.WIRE_VERSION, "Content-Type": content_type}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        for attempt in range(self.retries + 1):
            try:
                async with self._session.request(method, self.url + path, data=data, headers=headers) as resp:
                    status, resp_headers, body = resp.status, resp.headers, await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if attempt == self.retries:
                    raise Unavailable(f"{method} {self.url}{path} failed: {e!r}") from None
                await asyncio.sleep(self.backoff * 2**attempt)
                continue
            if status in RETRY_STATUSES and attempt < self.retries:
                await asyncio.sleep(self.backoff * 2**attempt)
                continue
            if status >= 400 and not (status == 404 and path.startswith(wire.CHUNKS_PATH)):
                raise wire.error_from_response(status, body)
            return status, resp_headers, body
        raise AssertionError("unreachable")

    async def _akeys(self, path: str, keys: Sequence[str]) -> bytes:
        for key in keys:
            validate_key(key)
        return (await self._arequest("POST", path, json.dumps({"keys": list(keys)}), wire.JSON_CONTENT_TYPE))[
            1
        ]

    async def aget_blob(self, key: str) -> Blob | None:
        status, body = await self._arequest("GET", wire.chunk_path(validate_key(key)))
        return None if status == 404 else body

    async def aput_blob(self, key: str, blob: Blob) -> list[str]:
        _, headers, _ = await self._arequest_headers("PUT", wire.chunk_path(validate_key(key)), blob)
        return _tiers(headers.get(wire.STORED_IN_HEADER))

    async def aexists(self, key: str) -> bool:
        return (await self._arequest("HEAD", wire.chunk_path(validate_key(key))))[0] == 200

    async def adelete(self, key: str) -> bool:
        return (await self._arequest("DELETE", wire.chunk_path(validate_key(key))))[0] != 404

    async def abatch_get(self, keys: Sequence[str]) -> list[Blob | None]:
        if not keys:
            return []
        got_keys, blobs = wire.decode_frame(await self._akeys(wire.BATCH_GET_PATH, keys), allow_missing=True)
        if got_keys != list(keys):
            raise InvalidArgument("server answered a batch get with other keys than asked")
        return blobs

    async def abatch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]:
        if not items:
            return []
        keys = [validate_key(k) for k, _ in items]
        body = b"".join(wire.encode_frame(keys, [b for _, b in items]))
        _, reply = await self._arequest("POST", wire.BATCH_PUT_PATH, body, wire.BATCH_CONTENT_TYPE)
        return json.loads(reply)["stored_in"]

    async def abatch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in json.loads(await self._akeys(wire.BATCH_EXISTS_PATH, keys))["exists"]]

    async def alookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        if not keys:
            return 0, None
        return _lookup_answer(json.loads(await self._akeys(wire.LOOKUP_PATH, keys)))

    async def alookup_prefix(self, keys: Sequence[str]) -> int:
        return (await self.alookup(keys))[0]

    async def astats(self) -> dict[str, Any]:
        return json.loads((await self._arequest("GET", wire.STATS_PATH))[1])

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self.close()

    def __enter__(self) -> RemoteBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lookup_answer(answer: dict[str, Any]) -> tuple[int, str | None]:
    miss = answer.get("miss")  # servers before miss reasons answer without it
    return int(answer["prefix"]), miss if isinstance(miss, str) else None


def _miss_reasons(frame: Any, blobs: Sequence[Blob | None]) -> list[str | None]:
    """Why each miss of a batch get answer missed, from its frame header (None for hits)."""
    given = wire.parse_frame_header(frame, allow_missing=True).reasons or [None] * len(blobs)
    return [
        None if b is not None else (r if isinstance(r, str) else "not_stored")
        for b, r in zip(blobs, given, strict=True)
    ]


def _tiers(header: str | None) -> list[str]:
    """The tiers an acknowledgement names (`X-KVStore-Stored-In: cpu,disk`)."""
    return [t for t in (header or "").split(",") if t]
