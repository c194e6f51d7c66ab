"""A lean, thread-safe HTTP/1.1 client for kvstore-server (docs/design.md §6).

Raw sockets: a keep-alive pool, TCP_NODELAY, bodies sent with `sendall` straight from the caller's
buffers and received with `recv_into` one buffer chosen by the caller (`into(n)`), so nothing is
joined or copied on the way. Requests are retried on connection errors and 502/503/504 as
`kvstore.sdk.options.ClientOptions` says (the data plane's client retries the same way). Errors arrive as the
`kvstore.errors` type the server named in its JSON body.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.sdk.buffers import fresh_buffer
from kvstore.sdk.options import RETRY_STATUSES, ClientOptions
from kvstore.sdk.pool import ConnectionPool

from kvstore.errors import InvalidArgument
from kvstore.protocol import Blob, wire

_SMALL = 64 * 1024  # bodies up to this size are sent in one write with the headers
Into = Callable[[int], memoryview]  # gives the buffer a body of n bytes is received into


def _busy(resp: Response) -> float | None:
    """Busy (502/503/504): retried after the server's Retry-After (seconds, at most 1 s), as the data
    plane's are; None for an answer to return."""
    if resp.status not in RETRY_STATUSES:
        return None
    try:
        return min(max(float(resp.headers.get("retry-after", 0)), 0.0), 1.0)
    except ValueError:  # an HTTP date, or garbage: the policy's own backoff
        return 0.0


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytearray | memoryview) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(bytes(self.body))


def tls_context(verify_tls: bool | str) -> ssl.SSLContext:
    """The TLS context of an https:// server: verified against the system's CAs, or the CA file
    `verify_tls` names, or (False) not verified at all."""
    tls = ssl.create_default_context(cafile=verify_tls if isinstance(verify_tls, str) else None)
    if verify_tls is False:
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    return tls


def connect(host: str, port: int, timeout: float, connect_timeout: float, tls: ssl.SSLContext | None):
    sock = socket.create_connection((host, port), timeout=connect_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    sock.settimeout(timeout)
    return sock


def send_buffers(sock: socket.socket, head: bytes, body: Sequence[Blob]) -> None:
    """`head` then each buffer of `body`, without joining large ones."""
    if sum(memoryview(b).nbytes for b in body) <= _SMALL:
        sock.sendall(b"".join([head, *body]))
        return
    sock.sendall(head)
    for part in body:
        sock.sendall(part)


class _Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # bytes received past the end of the last response (none normally)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _fill(self) -> None:
        # Small reads while looking for the end of the headers: the body then lands in its own buffer
        # through recv_into, instead of being copied out of this one.
        data = self.sock.recv(16 * 1024)
        if not data:
            raise ConnectionError("server closed the connection")
        self.pending += data

    def receive(self, head_only: bool, into: Into) -> tuple[Response, bool]:
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
        n = int(headers["content-length"])
        # error bodies are small JSON: only a successful body goes into the caller's buffer
        return Response(status, headers, self._read_exact(n, into if status < 300 else fresh_buffer)), keep

    def _read_exact(self, n: int, into: Into) -> memoryview:
        view = into(n)
        got = min(n, len(self.pending))
        view[:got] = self.pending[:got]
        del self.pending[:got]
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError(f"server closed the connection after {got} of {n} body bytes")
            got += r
        return view

    def _read_chunked(self) -> bytearray:
        body = bytearray()
        while True:
            while (end := self.pending.find(b"\r\n")) < 0:
                self._fill()
            size = int(bytes(self.pending[:end]).split(b";")[0], 16)
            del self.pending[: end + 2]
            chunk = self._read_exact(size + 2, fresh_buffer)
            if size == 0:
                return body
            body += chunk[:size]


class HttpClient:
    """Talks HTTP to one kvstore-server. Thread-safe (a pool of keep-alive connections)."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        token: str | None,
        options: ClientOptions,
    ) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.options = options
        self.base = f"{'https' if tls else 'http'}://{host if ':' not in host else f'[{host}]'}:{port}"
        host_header = host if ":" not in host else f"[{host}]"
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._common = (
            f"Host: {host_header}:{port}\r\n{auth}{wire.WIRE_VERSION_HEADER}: {wire.WIRE_VERSION}\r\n"
        )
        self.pool: ConnectionPool[_Connection] = ConnectionPool(options.pool_size)

    def _open(self) -> _Connection:
        opts = self.options
        return _Connection(connect(self.host, self.port, opts.timeout, opts.connect_timeout, self.tls))

    def request(
        self,
        method: str,
        path: str,
        body: Sequence[Blob] = (),
        content_type: str = wire.BLOB_CONTENT_TYPE,
        into: Into = fresh_buffer,
    ) -> Response:
        """One HTTP exchange, retried on connection errors and 502/503/504 (`ClientOptions`); raises on
        any other >= 400 except a 404 from a chunk route, which the caller turns into None / False."""
        if self.pool.closed:
            raise InvalidArgument("this client is closed")
        length = sum(memoryview(b).nbytes for b in body)
        head = (
            f"{method} {path} HTTP/1.1\r\n{self._common}Content-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()

        def once() -> Response:
            conn = self.pool.take(self._open)
            try:
                try:
                    send_buffers(conn.sock, head, body)
                except OSError:
                    pass  # the server may have answered early (401, 413) and closed: read that answer
                resp, keep = conn.receive(method == "HEAD", into)
            except BaseException:
                conn.close()
                raise
            if keep:
                self.pool.release(conn)
            else:
                conn.close()
            return resp

        resp = self.options.with_retries(f"{method} {self.base}{path}", once, _busy)
        if resp.status >= 400 and not (resp.status == 404 and path.startswith(wire.CHUNKS_PATH)):
            raise wire.error_from_response(resp.status, bytes(resp.body))
        return resp

    def keys_request(self, path: str, keys: Sequence[str], into: Into = fresh_buffer) -> Response:
        payload = json.dumps({"keys": list(keys)}).encode()
        return self.request("POST", path, [payload], wire.JSON_CONTENT_TYPE, into)

    def close(self) -> None:
        self.pool.close()
