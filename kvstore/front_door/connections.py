"""What one connection may cost the server, before a request reaches the middlewares.

- A connection limit: beyond `max_connections` open connections (HTTP and data plane together) a new
  one gets a canned 503 (JSON, Retry-After) and is closed before a byte of its request is read
  (kvstore.front_door.listener applies it when a connection opens). The limit is kept below the
  process's file-descriptor limit (RLIMIT_NOFILE) minus a reserve for the tiers' own files and
  sockets, so that the disk tier and Redis never see EMFILE because clients took every descriptor.
- A header-read timeout: a request whose headers have not all arrived `header_timeout` seconds after
  their first byte gets a 408 and the connection is closed (slow-loris clients).
- A keep-alive idle timeout (`keepalive_timeout`): aiohttp closes a connection that sends nothing for
  that long; kvstore.front_door.listener closes one that connected and never sent anything, and the data plane
  its idle connections, after the same time.
- Requests the HTTP parser rejects (bad request line, bad Content-Length...) get our JSON error body.

The same machinery is the front door of `kvstore-engine router` (kvstore.engine.router.app.listen): its
guard answers in the engines' OpenAI error shape (`ConnectionGuard.shape`) and counts in its own metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from kvstore.protocol import wire

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors kept for the tiers (disk files, Redis sockets), logs, the event loop


def connection_limit(configured: int, store_threads: int, fds_per_connection: int = 1) -> int:
    """`configured`, lowered to fit under RLIMIT_NOFILE with FD_RESERVE (+ 2 per store thread) spare;
    `fds_per_connection`: descriptors one connection may hold (a proxy: its client's and its upstream's)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = (soft - FD_RESERVE - 2 * store_threads) // fds_per_connection
    limit = min(configured, max(room, 8))
    if limit < configured:
        log.warning(
            "max_connections lowered from %d to %d to fit RLIMIT_NOFILE %d (raise it with ulimit -n)",
            configured, limit, soft,
        )  # fmt: skip
    return limit


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (what servers do at start; the default soft 1024 is low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)


class GuardCounters(Protocol):
    """What a guard counts in: kvstore.server.metrics.ServerMetrics, the router's RouterMetrics."""

    refused_connections: Any  # prometheus Counters
    header_timeouts: Any


def kvstore_shape(status: int, message: str, type_name: str) -> dict[str, Any]:
    """kvstore-server's error body."""
    return {"error": message, "type": type_name}


@dataclass
class ConnectionGuard:
    max_connections: int
    header_timeout: float
    metrics: GuardCounters
    shape: Callable[[int, str, str], dict[str, Any]] = field(default=kvstore_shape)  # the error body


def _canned(
    guard: ConnectionGuard, status: int, reason: str, message: str, type_name: str, extra: str = ""
) -> bytes:
    body = json.dumps(guard.shape(status, message, type_name)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def refuse(transport: asyncio.BaseTransport, guard: ConnectionGuard) -> None:
    """Answer a connection over the limit with a canned 503 before reading a byte of it, and close it."""
    guard.metrics.refused_connections.inc()
    message = f"over the server's limit of {guard.max_connections} connections; retry shortly"
    transport.write(_canned(guard, 503, "Service Unavailable", message, "Busy", "Retry-After: 1\r\n"))  # type: ignore[attr-defined]
    transport.close()


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, with the header timeout and JSON parser errors of the module
    docstring (kvstore.front_door.listener builds one per HTTP connection and applies the connection limit). The
    constructor, `handle_error` and the attributes read here are aiohttp internals:
    tests/server/test_aiohttp_canary.py fails loudly when they change (pyproject pins aiohttp)."""

    _header_timer: asyncio.TimerHandle | None = None

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not data or self._force_close:
            return
        between_requests = not self._request_in_progress and not self._messages
        if between_requests and self._header_timer is None:  # the first bytes of a request's headers
            self._header_timer = self._loop.call_later(self.guard.header_timeout, self._headers_late)
        elif not between_requests and self._header_timer is not None:  # they are all here
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._request_in_progress or self._messages or self._force_close or self.transport is None:
            return
        self.guard.metrics.header_timeouts.inc()
        if self._waiter is not None:  # waiting for a request whose headers never finished
            message = f"request headers did not arrive within {self.guard.header_timeout:g} s"
            self.transport.write(_canned(self.guard, 408, "Request Timeout", message, "InvalidArgument"))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def handle_error(self, request, status=500, exc=None, message=None):  # type: ignore[no-untyped-def]
        if isinstance(exc, HttpProcessingError) and 400 <= status < 500:
            # A request the parser refused. Its message quotes the offending bytes, which may be a
            # header holding a token (a multi-line one, a control character): neither the log nor the
            # answer repeats them, only what was wrong.
            text = f"bad HTTP request: {_first_line(exc.message) or f'HTTP {status}'}"
            log.info("%s (from %s)", text, request.remote)
        else:
            super().handle_error(request, status, exc, message)  # logs; raises if a response started
            text = message or (f"bad HTTP request: {exc}" if exc else f"HTTP {status}")
            text = text if len(text) <= 300 else text[:300] + "..."
        type_name = "InvalidArgument" if 400 <= status < 500 else "KVStoreError"
        if self.guard.shape is kvstore_shape:  # as kvstore.server.middleware.json_error writes it
            body = json.dumps(kvstore_shape(status, text, type_name)).encode()
            resp = web.Response(status=status, body=body, content_type=wire.JSON_CONTENT_TYPE)
        else:
            resp = web.json_response(self.guard.shape(status, text, type_name), status=status)
        resp.force_close()
        return resp


def _first_line(message: object) -> str:
    """What a parser error says was wrong, without the request bytes it quotes after the first line."""
    return str(message or "").strip().split("\n", 1)[0].rstrip(":").strip()[:200]
