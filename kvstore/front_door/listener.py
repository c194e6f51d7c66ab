"""One port, two protocols: the first byte of a connection picks HTTP (aiohttp) or the data plane.

`PREFACE[0]` (0x89) never starts an HTTP request line, so an HTTP client is handed to aiohttp after one
read, with no change in what it sees. aiohttp's per-connection handler is built here (`web.Server`
documents itself as a protocol factory for `loop.create_server`; the handler class is
kvstore.front_door.connections.GuardedHandler). The connection limit counts both protocols, and a connection that
says nothing is closed after `keepalive_timeout`, as aiohttp closes its idle ones.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiohttp import web

from kvstore.front_door.connections import ConnectionGuard, GuardedHandler, refuse
from kvstore.protocol import dataplane as dp

log = logging.getLogger(__name__)


class Plane(Protocol):
    """What the listener needs of a data plane (kvstore.server.dataplane.DataPlane): its open
    connections and a protocol for a new one."""

    connections: Any  # a sized collection

    def protocol(self) -> Any: ...


class Listener:
    """The protocol factory of the server's socket, and the count of its open connections."""

    def __init__(
        self,
        http: web.Server,
        guard: ConnectionGuard,
        handler_kwargs: dict[str, Any],
        plane: Plane | None,
        idle_timeout: float,
    ) -> None:
        self.http, self.guard, self.handler_kwargs, self.plane = http, guard, handler_kwargs, plane
        self.idle_timeout = idle_timeout
        self.pending: set[Sniffer] = set()  # connected, first bytes not in yet

    def open_connections(self) -> int:
        plane = 0 if self.plane is None else len(self.plane.connections)
        return len(self.http.connections) + plane + len(self.pending)

    def __call__(self) -> Sniffer:
        return Sniffer(self)


class Sniffer(asyncio.Protocol):
    """Reads until the first byte (or, for the data plane, the whole preface) is known, then hands the
    transport and those bytes to the protocol that speaks it."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: Any = None
        self.data = b""
        self._idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        lis = self.listener
        if lis.open_connections() >= lis.guard.max_connections:
            refuse(transport, lis.guard)
            return
        lis.pending.add(self)
        self._idle = asyncio.get_running_loop().call_later(lis.idle_timeout, transport.close)

    def data_received(self, data: bytes) -> None:
        self.data += data
        lis = self.listener
        if lis.plane is not None and self.data[0] == dp.PREFACE_FIRST_BYTE:
            if len(self.data) < len(dp.PREFACE):
                return
            self._handed_over()
            proto = lis.plane.protocol()
            self.transport.set_protocol(proto)
            proto.connection_made(self.transport)
            proto.start(self.data)
            return
        self._handed_over()
        handler = GuardedHandler(lis.http, lis.guard, loop=asyncio.get_running_loop(), **lis.handler_kwargs)
        self.transport.set_protocol(handler)
        handler.connection_made(self.transport)
        handler.data_received(self.data)

    def _handed_over(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.listener.pending.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._handed_over()  # closed before it said anything
