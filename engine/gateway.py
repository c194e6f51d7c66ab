"""What the proxy and the router share: the front door they listen behind (`FrontDoor`: kvstore-server's
connection rules from kvstore.front_door, header / body / idle deadlines, its cross-origin rules),
their one serving loop, and how they name an engine that fails them (upstream errors and timeouts;
credentials in an engine URL are used, never shown)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web
from aiohttp.log import access_logger
from kvstore.engine.errors import EngineError, error_body
from kvstore.engine.server_middleware import hosts_list
from prometheus_client import CollectorRegistry, Counter

from kvstore.front_door.connections import ConnectionGuard, connection_limit, raise_fd_limit
from kvstore.front_door.listener import Listener

logger = logging.getLogger(__name__)
DOOR_KEY = web.AppKey("front_door", object)
CONNECT_TIMEOUT_S = 10.0  # to open a connection to an engine (at most --timeout)


class BadGateway(EngineError):
    """An upstream engine that could not serve the request."""

    status = 502


class EngineUnreachable(BadGateway):
    """The engine could not be connected to: it never got the request (another one may serve it)."""


class EngineHung(BadGateway):
    """The engine took the request and sent nothing back in time (or stopped answering its health
    probe meanwhile): another one may serve it."""

    status = 504


class Busy(EngineError):
    """Too much is in flight here for one more request now: retry in a moment."""

    status = 503
    retry_after = 1


def redact(url: str) -> str:
    """`url` without its credentials (http://user:pass@host:port -> http://host:port): how an engine is
    named in every header, message, metric and log."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host))


def between_bytes(timeout_s: float) -> aiohttp.ClientTimeout:
    """An upstream request's timeout: `timeout_s` of silence between two reads (the first one
    included), not a total; connecting within CONNECT_TIMEOUT_S."""
    return aiohttp.ClientTimeout(
        total=None, sock_connect=min(timeout_s, CONNECT_TIMEOUT_S), sock_read=timeout_s
    )


@dataclass
class FrontDoor:
    """What one client connection may cost the router or the proxy: kvstore-server's rules
    (kvstore.front_door.connections) and its cross-origin ones (kvstore.engine.server_middleware.browser_guard)."""

    max_connections: int = 1024  # beyond: a canned 503 (also kept under RLIMIT_NOFILE, 2 fds each)
    header_timeout_s: float = 10.0  # from a request's first byte to its last header line: else 408
    body_timeout_s: float = 30.0  # to receive a whole body: else 408
    keepalive_timeout_s: float = 30.0  # an idle connection (or one that never sends) is closed after it
    allowed_hosts: list[str] = field(default_factory=list)  # Host names besides IPs and localhost ("*": any)
    host: str = "127.0.0.1"  # the address it listens on (a name there is allowed too)
    counters: Any = None  # refused_connections, header_timeouts (prometheus Counters)

    def __post_init__(self) -> None:
        if (
            min(self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s) <= 0
            or self.max_connections < 1
        ):
            raise ValueError(
                "--header-timeout, --body-timeout, --keepalive-timeout and --max-connections must be positive"
            )
        if self.counters is None:
            self.counters = DoorCounters(CollectorRegistry())


class DoorCounters:
    """The front door's counters, in `registry` (the router's /metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused_connections = Counter(
            "kvstore_router_refused_connections",
            "Connections answered 503 over --max-connections",
            registry=registry,
        )
        self.header_timeouts = Counter(
            "kvstore_router_header_timeouts", "Connections closed: headers not in within --header-timeout",
            registry=registry,
        )  # fmt: skip


def add_front_door_args(p: argparse.ArgumentParser, port: int) -> None:
    """The options of the proxy's and the router's listening side (FrontDoor) and upstream timeout."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port, help="0 picks a free port")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds an engine may send nothing while it answers (between bytes, not in total: "
                        "a stream still producing is never cut); a client reading nothing for as long is closed")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds requests in flight at SIGTERM may still run")  # fmt: skip
    d = FrontDoor()
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open client connections; beyond, a fast 503 (kept under RLIMIT_NOFILE)")  # fmt: skip
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds from a request's first byte to its last header (else 408, closed)")  # fmt: skip
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds to receive a whole request body (else 408)")  # fmt: skip
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s,
                   help="seconds an idle client connection stays open")  # fmt: skip
    p.add_argument("--allowed-hosts", type=hosts_list, default=[], metavar="HOSTS",
                   help="host names clients may use besides IP addresses and localhost (comma list; * = any): "
                        "a request naming another Host is refused, against DNS rebinding")  # fmt: skip


def front_door(ns: argparse.Namespace, registry: CollectorRegistry | None = None) -> FrontDoor:
    counters = DoorCounters(registry) if registry is not None else None
    return FrontDoor(ns.max_connections, ns.header_timeout, ns.body_timeout, ns.keepalive_timeout,
                     ns.allowed_hosts, ns.host, counters)  # fmt: skip


@contextlib.asynccontextmanager
async def listening(
    app: web.Application, host: str, port: int, shutdown_timeout: float = 5.0
) -> AsyncIterator[str]:
    """Serve `app` on host:port behind its FrontDoor (kvstore-server's Listener and GuardedHandler, in
    the engines' error shape); yields its URL. Leaving stops accepting, then drains (on_shutdown)."""
    door: FrontDoor = app[DOOR_KEY]
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    server: asyncio.AbstractServer | None = None
    try:
        assert runner.server is not None
        guard = ConnectionGuard(
            connection_limit(door.max_connections, 0, fds_per_connection=2), door.header_timeout_s,
            door.counters, shape=lambda status, message, _type: error_body(status, message),
        )  # fmt: skip
        kwargs = {"access_log": access_logger, "keepalive_timeout": door.keepalive_timeout_s}
        factory = Listener(runner.server, guard, kwargs, None, door.keepalive_timeout_s)
        server = await asyncio.get_running_loop().create_server(factory, host, port, backlog=1024)
        bound = server.sockets[0].getsockname()[1]
        yield f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()


def serve(app: web.Application, host: str, port: int, name: str, shutdown_timeout: float) -> None:
    """Run `app` on host:port until SIGTERM/SIGINT (the proxy's and the router's one serving loop)."""
    raise_fd_limit()

    async def main() -> None:
        async with listening(app, host, port, shutdown_timeout) as url:
            print(f"kvstore-engine {name} listening on {url}", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            logger.info("stopping: no new connections, draining in-flight requests")

    asyncio.run(main())
