"""`kvstore-engine proxy`: disaggregated prefill/decode in front of two engine servers, like vLLM's
disaggregated-prefill proxy.

    client --> proxy --(max_tokens=1)--> prefill engine (--kv-role prefill): computes the prompt's KV,
                  |                        saves every full chunk to the shared kvstore, answers
                  +--(original request)--> decode engine (--kv-role decode): loads those chunks from
                                           the store, recomputes only the tail, streams the answer back

Both engines must share one store (`--kv-store-url http://...`). Several `--prefill` / `--decode`
URLs are used round-robin. An engine that cannot be reached is a 502 with an OpenAI-style JSON error.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
CONFIG_KEY = web.AppKey("proxy_config", object)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class ProxyConfig:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    def next_prefill(self) -> str:
        return next(self._prefill)

    def next_decode(self) -> str:
        return next(self._decode)


def _error(status: int, message: str, kind: str = "BadGateway") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The same request, cut to its first token and not streamed: the prefill engine's part."""
    req = dict(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["n"] = 1
    return req


async def _handle(request: web.Request, path: str) -> web.StreamResponse:
    session = request.app[SESSION_KEY]
    config: ProxyConfig = request.app[CONFIG_KEY]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the request body is not valid JSON", "BadRequestError")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object", "BadRequestError")
    prefill_url = config.next_prefill()
    try:
        async with session.post(prefill_url + path, json=prefill_request(body)) as resp:
            payload = await resp.read()
            if resp.status != 200:  # a bad request is bad for the decode engine too: pass it on
                return web.Response(body=payload, status=resp.status, content_type="application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(502, f"prefill engine {prefill_url} failed: {e!r}")
    decode_url = config.next_decode()
    try:
        async with session.post(decode_url + path, json=body) as resp:
            out = web.StreamResponse(status=resp.status)
            for k, v in resp.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    out.headers[k] = v
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(502, f"decode engine {decode_url} failed: {e!r}")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "/v1/chat/completions")


async def models(request: web.Request) -> web.Response:
    config: ProxyConfig = request.app[CONFIG_KEY]
    url = config.decode_urls[0]
    try:
        async with request.app[SESSION_KEY].get(url + "/v1/models") as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(502, f"decode engine {url} failed: {e!r}")


async def health(request: web.Request) -> web.Response:
    config: ProxyConfig = request.app[CONFIG_KEY]
    session = request.app[SESSION_KEY]
    down = []
    for url in [*config.prefill_urls, *config.decode_urls]:
        try:
            async with session.get(url + "/health") as resp:
                if resp.status != 200:
                    down.append(url)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            down.append(url)
    if down:
        return _error(503, f"engines not healthy: {', '.join(down)}", "ServiceUnavailable")
    return web.json_response({"status": "ok"})


def build_app(config: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[CONFIG_KEY] = config

    async def on_startup(_: web.Application) -> None:
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=config.timeout)

    async def on_cleanup(_: web.Application) -> None:
        await app[SESSION_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="prefill engine URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode engine URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200, help="0 picks a free port")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")


def run_proxy(ns: argparse.Namespace) -> None:
    config = ProxyConfig(ns.prefill, ns.decode, ns.timeout)
    app = build_app(config)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, ns.host, ns.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"kvstore-engine proxy listening on http://{ns.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
