"""The router's `/dashboard`: one page (static/dashboard.html) that polls `/v1/router/state` and
draws a panel per engine; its figures' script (static/dashboard.js, which tests also run in node) is
put inline, as kvstore-server's dashboard does."""

from __future__ import annotations

from importlib import resources

from aiohttp import web

_FIGURES = b'<script src="dashboard.js"></script>'


async def dashboard(request: web.Request) -> web.Response:
    static = resources.files("kvstore.engine.router").joinpath("static")
    figures = static.joinpath("dashboard.js").read_bytes()
    html = (
        static.joinpath("dashboard.html")
        .read_bytes()
        .replace(_FIGURES, b"<script>\n" + figures + b"</script>")
    )
    return web.Response(body=html, content_type="text/html", charset="utf-8")
