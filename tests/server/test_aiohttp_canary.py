"""Canary: the server builds aiohttp's per-connection handler itself (kvstore.front_door.listener) from a subclass
(kvstore.front_door.connections.GuardedHandler) that overrides `handle_error` and reads a few of its attributes,
none of which aiohttp documents. When an upgrade changes them, these fail loudly (pyproject.toml pins
aiohttp below the next minor release); the behaviour they protect is tested in test_malformed.py
(JSON errors from the HTTP parser) and test_limits.py (header timeouts)."""

from __future__ import annotations

import asyncio
import inspect

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from kvstore.server.metrics import ServerMetrics

from kvstore.front_door.connections import ConnectionGuard, GuardedHandler


def test_request_handler_signatures():
    init = inspect.signature(RequestHandler.__init__).parameters
    assert list(init)[:2] == ["self", "manager"]
    assert {"loop", "access_log", "keepalive_timeout"} <= set(init)
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == [
        "self", "request", "status", "exc", "message",
    ]  # fmt: skip


def test_a_handler_is_built_from_a_web_server():
    async def build() -> None:
        async def handler(request: web.BaseRequest) -> web.Response:
            return web.Response()

        server = web.Server(handler)
        guard = ConnectionGuard(8, 1.0, ServerMetrics())
        proto = GuardedHandler(server, guard, loop=asyncio.get_running_loop(), access_log=None)
        assert isinstance(proto, asyncio.Protocol) and proto.access_logger is None
        for name in ("_request_in_progress", "_messages", "_waiter", "_force_close", "_loop", "_manager"):
            getattr(proto, name)  # what GuardedHandler reads
        assert proto._manager is server and proto._loop is asyncio.get_running_loop()

    asyncio.run(build())
