"""The aiohttp application: routes, middlewares, the stats sampler (connections: server/connections.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from importlib import resources
from typing import Any

from aiohttp import web
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import BUCKETS
from kvstore.server.middleware import make_middlewares
from kvstore.server.routes import routes as data_routes
from kvstore.server.state import DATAPLANE, SAMPLER, STATE, ServerState

from kvstore import __version__
from kvstore.config import StoreConfig
from kvstore.front_door.origin import HostCheck
from kvstore.protocol import wire

log = logging.getLogger(__name__)
control = web.RouteTableDef()


@control.get("/healthz", name="health")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@control.get(wire.STATS_PATH, name="stats")
async def stats(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    data = await st.call(st.store.stats)
    server = {
        "version": __version__,
        "requests": st.metrics.totals["requests"],
        "errors": st.metrics.totals["errors"],
    }
    plane = request.app.get(DATAPLANE)
    if plane is not None:
        server["dataplane_connections"] = len(plane.connections)
        server["shm"] = {"segments": len(plane.shm), "bytes": plane.shm.used, "budget": plane.shm.budget}
    data = dict(data, server=server)
    return web.json_response(data, dumps=lambda d: json.dumps(d, default=str))


@control.get(wire.HISTORY_PATH, name="history")
async def history(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    since = request.query.get("since")
    try:
        since_t = float(since) if since is not None else None
    except ValueError:
        raise web.HTTPBadRequest(text="since must be a unix timestamp") from None
    assert st.history is not None
    return web.json_response({
        "interval": st.config.sample_interval,
        "latency_buckets": list(BUCKETS),  # upper bounds in seconds; each list has one more: +Inf
        "samples": st.history.as_list(since_t),
    })  # fmt: skip


@control.get("/metrics", name="metrics")
async def metrics(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    body = st.metrics.render(getattr(st.store, "registry", None))
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


_FIGURES = b'<script src="dashboard_figures.js"></script>'


@control.get("/dashboard", name="dashboard")
async def dashboard(request: web.Request) -> web.Response:
    """The page, with its figures' script (static/dashboard_figures.js, which tests also run) inline."""
    static = resources.files("kvstore.server").joinpath("static")
    figures = static.joinpath("dashboard_figures.js").read_bytes()
    html = (
        static.joinpath("dashboard.html")
        .read_bytes()
        .replace(_FIGURES, b"<script>\n" + figures + b"</script>")
    )
    return web.Response(body=html, content_type="text/html", charset="utf-8")


@control.get("/", name="index")
async def index(request: web.Request) -> web.Response:
    raise web.HTTPFound("/dashboard")


async def _start_sampler(app: web.Application) -> None:
    st: ServerState = app[STATE]
    assert st.history is not None

    async def sample() -> Any:
        return await st.call(st.store.stats)

    app[SAMPLER] = asyncio.create_task(
        st.history.run(st.config.sample_interval, sample, st.metrics.totals_now, st.metrics.registry)
    )


async def _stop_sampler(app: web.Application) -> None:
    task = app.get(SAMPLER)
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


def make_app(store: Any, store_config: StoreConfig, config: ServerConfig) -> web.Application:
    """The application over an open store. The caller owns the store (flush/close on shutdown)."""
    state = ServerState(store, store_config, config)
    app = web.Application(
        middlewares=make_middlewares(
            config.token(), state.metrics, config.metrics_auth, HostCheck(config.allowed_hosts, config.host)
        ),
        client_max_size=config.max_request_size,
    )
    app[STATE] = state
    app.add_routes(data_routes)
    app.add_routes(control)
    app.on_startup.append(_start_sampler)
    app.on_shutdown.append(_stop_sampler)
    return app
