"""The SDK side of the binary data plane (kvstore.protocol.dataplane): a pool of connections that said HELLO.

Sync and thread-safe like `kvstore.sdk.http.HttpClient`, with the same options and retries
(`kvstore.sdk.options.ClientOptions`): every call is idempotent.
A request sends its header, meta and blobs in one `sendmsg` (no join); a response's body lands with
`recv_into` in the buffer the caller picks. Connections that named a shared-memory segment remember
it, so a segment is attached once per connection.

Waiting for the answer of a server on this host, a thread first polls the socket for up to `spin_s`
(yielding the CPU between polls) before it sleeps in `recv`: a sleeping thread is woken by an
interrupt to its CPU, which on a virtual machine costs tens of microseconds per message, as much as
the server's whole work on a small request (measured here: exists 211 -> 156 us, a 1 MiB lease
390 -> 290 us, a 256 KiB get over TCP 448 -> 330 us). At most half the CPUs spin at once per process.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.sdk.buffers import fresh_buffer
from kvstore.sdk.http import Into, connect
from kvstore.sdk.options import RETRY_STATUSES, ClientOptions
from kvstore.sdk.pool import ConnectionPool

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.protocol import Blob, shm
from kvstore.protocol import dataplane as dp

log = logging.getLogger(__name__)
_RX = 4096  # first read of a response: its header and meta, a few body bytes at most
SPIN_S = 200e-6  # how long a thread polls for a same-host server's answer before it sleeps
_MAX_SPINNERS = max(1, (os.cpu_count() or 2) // 2)
_spinners = 0
_spin_lock = threading.Lock()


class NotSpoken(Exception):
    """The server does not speak the data plane (an older server, or it is turned off)."""


class SegmentGone(Exception):
    """The server no longer knows a shared-memory segment (it restarted): map a new one."""


def _sendmsg(sock: socket.socket, parts: list[Any]) -> None:
    if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rx = bytearray(_RX)
        self.segments: set[int] = set()
        self.spin_s = 0.0  # set once HELLO says the server is on this host (plain sockets only)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def exchange(
        self, op: int, meta: dict, body: Sequence[Blob] = (), flags: int = 0, into: Into = fresh_buffer
    ) -> tuple[dp.Head, dict, memoryview | None]:
        body_len = sum(memoryview(b).nbytes for b in body)
        try:
            _sendmsg(self.sock, [dp.pack_head(op, dp.pack_meta(meta), body_len, flags), *body])
        except OSError:
            if not body_len:
                raise
            # the server may have answered early (413, 503 Busy) and closed: read that answer
        return self.receive(into)

    def receive(self, into: Into) -> tuple[dp.Head, dict, memoryview | None]:
        rx = memoryview(self.rx)
        have = 0
        while have < dp.HEAD_SIZE:
            have += self._recv(rx[have:])
        if rx[:5] == b"HTTP/":
            raise NotSpoken("the server answered the data-plane preface with HTTP")
        head = dp.parse_head(rx)
        end = dp.HEAD_SIZE + head.meta_len
        if end > len(self.rx):
            rx.release()
            self.rx.extend(bytes(end - len(self.rx)))
            rx = memoryview(self.rx)
        while have < end:
            have += self._recv(rx[have:end])
        meta = dp.parse_meta(rx[dp.HEAD_SIZE : end])
        if not head.body_len:
            return head, meta, None
        body = into(head.body_len) if head.status < 300 or head.status == 404 else fresh_buffer(head.body_len)
        got = have - end
        body[:got] = rx[end:have]
        while got < head.body_len:
            got += self._recv(body[got:])
        return head, meta, body

    def _recv(self, view: memoryview) -> int:
        n = self._recv_spinning(view) if self.spin_s else self.sock.recv_into(view)
        if n == 0:
            raise ConnectionError("server closed the data-plane connection")
        return n

    def _recv_spinning(self, view: memoryview) -> int:
        global _spinners
        with _spin_lock:
            spin = _spinners < _MAX_SPINNERS
            _spinners += spin
        if not spin:
            return self.sock.recv_into(view)
        try:
            # A socket with a timeout is non-blocking underneath (Python polls before each call), so
            # readv on its descriptor returns at once; recv_into would poll for the whole timeout.
            fd, deadline = self.sock.fileno(), time.perf_counter() + self.spin_s
            while True:
                try:
                    return os.readv(fd, [view])
                except BlockingIOError:
                    if time.perf_counter() >= deadline:
                        return self.sock.recv_into(view)  # the socket's timeout from here on
                    os.sched_yield()  # a server waiting for this CPU runs now
        finally:
            with _spin_lock:
                _spinners -= 1


class DataPlaneClient:
    """Connections to one server's data plane. `hello` is the server's HELLO answer (its limits)."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        token: str | None,
        options: ClientOptions,
        *,
        local: bool = False,
        spin_s: float = SPIN_S,
    ) -> None:
        """`local`: reach a server on this host through the Unix socket its HELLO names (`unix`).
        `spin_s`: how long to poll for the answer of a server on this host before sleeping (0: never)."""
        assert 0 <= spin_s < 1, spin_s
        self.host, self.port, self.tls, self.token = host, port, tls, token
        self.local = local
        self.spin_s = spin_s
        self.unix_path: str | None = None
        self._unix_refused: set[str] = set()  # named by HELLO, but not reachable from here
        self.options = options
        self.hello: dict[str, Any] = {}
        self.pool: ConnectionPool[_Conn] = ConnectionPool(options.pool_size)
        conn = self._open()  # NotSpoken / Unauthorized / OSError now, not on the first call
        if self.unix_path is not None:  # a server on this host: its Unix socket from now on
            conn.close()
            conn = self._open()
        self.pool.release(conn)

    def _connect(self) -> socket.socket:
        if self.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.options.connect_timeout)
            try:
                sock.connect(self.unix_path)
                sock.settimeout(self.options.timeout)
                return sock
            except OSError as e:  # a server that went away, or another network namespace: TCP again
                sock.close()
                log.info("cannot reach the data plane's Unix socket (%s): TCP", e)
                self._unix_refused.add(self.unix_path)
                self.unix_path = None
        return connect(self.host, self.port, self.options.timeout, self.options.connect_timeout, self.tls)

    def _open(self) -> _Conn:
        conn = _Conn(self._connect())
        sock = conn.sock
        try:
            sock.sendall(dp.PREFACE)
            head, meta, _ = conn.exchange(dp.HELLO, {"v": dp.VERSION, "token": self.token})
        except BaseException:
            conn.close()
            raise
        if head.status != 200:
            conn.close()
            raise dp.error_from_meta(head.status, meta)
        self.hello = meta
        same_host = bool(shm.host_id()) and meta.get("host") == shm.host_id()
        unix = meta.get("unix")
        if self.local and isinstance(unix, str) and same_host:
            self.unix_path = None if unix in self._unix_refused else unix
        if same_host and not isinstance(sock, ssl.SSLSocket):
            conn.spin_s = self.spin_s
        return conn

    def call(
        self,
        op: int,
        meta: dict,
        body: Sequence[Blob] = (),
        flags: int = 0,
        into: Into = fresh_buffer,
        segment: Any = None,
    ) -> tuple[dp.Head, dict, memoryview | None]:
        """One request, retried on connection errors; raises the server's error for a status >= 400
        other than 404. `segment` (sdk.shm.ClientSegment): attach it first on a connection that has not."""
        if self.pool.closed:
            raise InvalidArgument("this client is closed")

        def once() -> tuple[dp.Head, dict, memoryview | None]:
            conn = self.pool.take(self._open)
            try:
                if segment is not None and segment.seg_id not in conn.segments:
                    h, m, _ = conn.exchange(dp.SHM_ATTACH, {"seg": segment.seg_id, "nonce": segment.nonce})
                    if h.status != 200:
                        self.pool.release(conn)
                        raise SegmentGone(m.get("error"))
                    conn.segments.add(segment.seg_id)
                answer = conn.exchange(op, meta, body, flags, into)
            except SegmentGone:
                raise  # (its connection went back to the pool: only the segment is gone)
            except BaseException:
                conn.close()
                raise
            if answer[0].flags & dp.FLAG_CLOSE:
                conn.close()
            else:
                self.pool.release(conn)
            return answer

        def busy(answer: tuple[dp.Head, dict, memoryview | None]) -> float | None:
            """Busy (502/503/504): retried as over HTTP, after the server's Retry-After (at most 1 s)."""
            head, reply, _ = answer
            return min(float(reply.get("retry_after", 0)), 1.0) if head.status in RETRY_STATUSES else None

        head, reply, got = self.options.with_retries(
            f"{dp.OP_NAMES.get(op, op)} on {self.host}:{self.port}", once, busy
        )
        if head.status >= 400 and head.status != 404:
            raise dp.error_from_meta(head.status, reply)
        return head, reply, got

    def tell(self, op: int, meta: dict) -> None:
        """A one-way message (TOUCH): sent on a pooled connection, never answered. Best effort: a
        connection that fails is dropped, nothing is retried (what it says is a hint)."""
        assert op in dp.ONE_WAY, op
        if self.pool.closed:
            return
        try:
            conn = self.pool.take(self._open)
        except (OSError, ConnectionError, KVStoreError) as e:
            log.debug("%s not sent: %s", dp.OP_NAMES[op], e)
            return
        try:
            _sendmsg(conn.sock, [dp.pack_head(op, dp.pack_meta(meta))])
        except OSError as e:
            log.debug("%s not sent: %s", dp.OP_NAMES[op], e)
            conn.close()
            return
        self.pool.release(conn)

    def open_segment(self, size: int) -> tuple[dict, Any] | None:
        """SHM_OPEN on a pooled connection: the server's answer and the connection, which stays out of
        the pool until `keep` (mapped: it is attached) or `drop` (not mapped: closing frees it); None
        when the server has no segment to give."""
        conn = self.pool.take(self._open)
        try:
            head, meta, _ = conn.exchange(dp.SHM_OPEN, {"size": size})
        except (OSError, ConnectionError, KVStoreError):
            conn.close()
            raise
        if head.status != 200 or meta.get("seg") is None:
            self.pool.release(conn)
            if head.status != 200:
                raise dp.error_from_meta(head.status, meta)
            return None
        conn.segments.add(meta["seg"])
        return meta, conn

    def keep(self, conn: _Conn) -> None:
        self.pool.release(conn)

    def drop(self, conn: _Conn) -> None:
        conn.close()

    def close(self) -> None:
        self.pool.close()
