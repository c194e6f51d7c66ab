"""Starting and stopping the server: a foreground `serve()` with graceful shutdown on SIGTERM/SIGINT,
and `ServerThread` for running one inside another process (tests, benchmarks, notebooks)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from kvstore.server.app import make_app
from kvstore.server.config import ServerConfig
from kvstore.server.dataplane import DataPlane
from kvstore.server.state import DATAPLANE, STATE

from kvstore.clock import SYSTEM, Clock
from kvstore.config import CpuMemory, StoreConfig
from kvstore.errors import ConfigError
from kvstore.front_door.connections import ConnectionGuard, connection_limit, raise_fd_limit
from kvstore.front_door.listener import Listener
from kvstore.protocol import shm
from kvstore.store_events import StoreEvents

log = logging.getLogger(__name__)


def server_cpu_memory(store_config: StoreConfig, config: ServerConfig) -> CpuMemory:
    """Where the server's cpu tier keeps its blobs: with shared memory on, "auto" is an arena that
    clients on this host map read-only (kvstore.tiers.arena), so their gets read blobs where they lie
    instead of having them copied, on a host with CUDA too (pinned pages of this process would serve
    no other process's GPU: a vLLM beside it copies to its device from its own buffers). "arena"
    without shared memory is a ConfigError: no client could map it."""
    shared = config.dataplane and config.shm_budget > 0 and shm.available()
    if store_config.cpu_memory == "arena" and not shared:
        raise ConfigError(
            "--cpu-memory arena needs shared memory: the data plane on, --shm-budget above 0 and memfd "
            "on this host"
        )
    return "arena" if store_config.cpu_memory == "auto" and shared else store_config.cpu_memory


def open_store(store_config: StoreConfig, config: ServerConfig, clock: Clock = SYSTEM) -> Any:
    """The server's store, its cpu tier's memory as `server_cpu_memory` says; `clock` the one its TTLs,
    miss log and breakers read (a test's `ManualClock`)."""
    from kvstore.store import TieredStore  # noqa: PLC0415 (imports torch; keep `--help` fast)

    memory = server_cpu_memory(store_config, config)
    return TieredStore(store_config.model_copy(update={"cpu_memory": memory}), clock=clock)


def warn_if_open(config: ServerConfig) -> bool:
    """A WARNING when the server listens beyond this host without a token (True then): anyone who can
    reach the port can then read, overwrite and delete every blob."""
    host = config.host.strip("[]")
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        local = False
    if local or config.token() is not None:
        return False
    log.warning(
        "listening on %s WITHOUT A TOKEN: anyone who can reach this port can read, overwrite and delete "
        "every blob. Give --auth-token-file FILE (make one: openssl rand -hex 32 > FILE), or bind "
        "--host 127.0.0.1",
        host or "every interface",
    )
    return True


class RunningServer:
    """An app listening on a socket. `url` has the bound port (useful with port 0)."""

    def __init__(self, store: Any, store_config: StoreConfig, config: ServerConfig) -> None:
        self.store = store
        self.store_config = store_config
        self.config = config
        self.app = make_app(store, store_config, config)
        self.kv_events = StoreEvents.attach(store, config.kv_events_config, config.token())  # None unless on
        metrics = self.app[STATE].metrics
        limit = connection_limit(config.max_connections, config.store_threads)
        self.guard = ConnectionGuard(limit, config.header_timeout, metrics)
        self.plane = DataPlane(self.app[STATE], config.token()) if config.dataplane else None
        self.app[DATAPLANE] = self.plane
        self.runner = web.AppRunner(self.app, shutdown_timeout=config.shutdown_timeout)
        self._handler_kwargs = {
            "access_log": log if config.access_log else None,
            "keepalive_timeout": config.keepalive_timeout,
        }
        self.listener: asyncio.Server | None = None
        self.unix_listener: asyncio.Server | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"{self.config.scheme}://{host}:{self.port}"

    async def start(self) -> str:
        warn_if_open(self.config)
        await self.runner.setup()
        http = self.runner.server
        assert http is not None
        factory = Listener(http, self.guard, self._handler_kwargs, self.plane, self.config.keepalive_timeout)
        self.app[STATE].metrics.connections = factory.open_connections
        self.listener = await asyncio.get_running_loop().create_server(
            factory, self.config.host, self.config.port, ssl=self.config.ssl_context(), backlog=1024
        )
        self.port = self.listener.sockets[0].getsockname()[1]
        if self.plane is not None and self.plane.shm.enabled:
            # Same-host clients reach the data plane through this abstract Unix socket (no file to leave
            # behind; HELLO names it): a loopback round trip costs ~half of TCP's.
            name = f"\0kvstore-{os.getpid()}-{self.port}-{secrets.token_hex(8)}"
            self.unix_listener = await asyncio.get_running_loop().create_unix_server(
                factory, name, backlog=1024
            )
            self.plane.unix_path = name
        # Not a second "listening on" line: the CLI prints that one, on stdout (issue 43).
        log.info("kvstore-server up: tiers %s, port %d", ",".join(self.store_config.tiers), self.port)
        return self.url

    async def drain(self) -> None:
        """Stop accepting connections and wait (up to shutdown_timeout) until no request is in flight.

        aiohttp's own cleanup stops reading from every connection at once, which would cut off an
        upload still arriving; so the listening socket closes first and the uploads get to finish."""
        for listener in (self.listener, self.unix_listener):
            if listener is not None:
                listener.close()
        metrics = self.app[STATE].metrics
        deadline = asyncio.get_running_loop().time() + self.config.shutdown_timeout
        while metrics.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if metrics.in_flight:
            log.warning("%d requests still in flight after %.0f s; closing them", metrics.in_flight,
                        self.config.shutdown_timeout)  # fmt: skip
        if self.plane is not None:
            self.plane.close()
        await self.runner.cleanup()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, then flush and close the store, all within
        shutdown_timeout: write-backs still queued then are not written (their keys were deleted from
        the lower tiers when they were queued, so a restart finds a miss, never an older blob)."""
        deadline = time.monotonic() + self.config.shutdown_timeout
        await self.drain()
        self.app[STATE].close()
        self.store.close(timeout=max(0.0, deadline - time.monotonic()))
        log.info("kvstore-server stopped; store flushed and closed")


def install_uvloop() -> None:
    try:
        import uvloop  # noqa: PLC0415

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # uvloop is a dependency, but the server still works on the stock loop
        log.warning("uvloop not available; using the default asyncio event loop")


async def serve(
    store_config: StoreConfig, config: ServerConfig, on_ready: Callable[[str], None] | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    raise_fd_limit()
    store = open_store(store_config, config)
    server = RunningServer(store, store_config, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await server.start()
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
        log.info("signal received; shutting down")
    finally:
        await server.stop()


class ServerThread:
    """A server on its own thread and event loop, over a store the caller owns or one it opens.

    with ServerThread(store, store_config, ServerConfig(port=0)) as srv:
        Store.connect(srv.url)
    """

    def __init__(
        self, store: Any, store_config: StoreConfig, config: ServerConfig, close_store: bool = False
    ):
        self.server = RunningServer(store, store_config, config)
        self.close_store = close_store
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-server", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> Any:
        return self.server.app[STATE]

    def _run(self) -> None:
        try:
            import uvloop  # noqa: PLC0415

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:  # reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self.loop is None or not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        fut.result(timeout=self.server.config.shutdown_timeout + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        if self.close_store:
            await self.server.stop()
        else:
            await self.server.drain()
            self.server.app[STATE].close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
