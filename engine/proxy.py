"""`kvstore-engine proxy`: disaggregated prefill/decode in front of two engine servers, like vLLM's
disaggregated-prefill proxy.

    client --> proxy --(max_tokens=1)--> prefill engine (--kv-role prefill): computes the prompt's KV,
                  |                        saves every full chunk to the shared kvstore, answers
                  +--(original request)--> decode engine (--kv-role decode): loads those chunks from
                                           the store, recomputes only the tail, streams the answer back

Both engines must share one store (`--kv-store-url http://...`). Several `--prefill` / `--decode`
URLs are used round-robin. A decode engine is health-checked (`--health-timeout`) before the prefill
runs, so a request is never prefilled for a decode engine that is down; the next one is tried. An
engine that cannot serve is a 502 whose message names it in one sentence. Errors are the engine
server's JSON shape; a stream that breaks after it started ends with an SSE `error` event. A client
that hangs up closes the upstream requests (the engines abort them); SIGTERM stops accepting, lets
in-flight requests finish for `--shutdown-timeout`, then ends the rest.

The front door (`kvstore.engine.gateway.FrontDoor`, the router's too): kvstore-server's connection rules
(kvstore.front_door.connections: a connection cap answered with a fast 503 and kept under RLIMIT_NOFILE,
a header deadline, an idle timeout), a body deadline, bodies over the engines' limit (8 MiB) refused
before they are read, and kvstore-server's cross-origin rules (kvstore.engine.server_middleware). Upstream,
`--timeout` bounds the silence between two reads of an engine's answer (not its whole length: a stream
still producing is never cut), and a client that reads nothing of its answer for as long is closed.
Credentials in an engine URL (http://user:pass@host) are used, never shown: every message names the
engine by its URL without them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from kvstore.engine.errors import error_body
from kvstore.engine.gateway import (
    DOOR_KEY,
    BadGateway,
    EngineHung,
    EngineUnreachable,
    FrontDoor,
    add_front_door_args,
    between_bytes,
    front_door,
    redact,
    serve,
)
from kvstore.engine.server_middleware import (
    MAX_BODY_BYTES,
    MAX_BODY_KEY,
    browser_guard,
    errors_middleware,
    host_check,
    parse_json,
    read_body,
    unless_disconnected,
)
from kvstore.engine.streaming import STREAM_KEY

logger = logging.getLogger(__name__)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
CONFIG_KEY = web.AppKey("proxy_config", object)
INFLIGHT_KEY = web.AppKey("in_flight", set)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}
_PARSE_ON_LOOP_BYTES = 256 * 2**10  # a larger body is parsed in a thread


class ProxyConfig:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout_s: float = 600.0,
        health_timeout_s: float = 2.0,
        shutdown_timeout_s: float = 10.0,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.timeout = between_bytes(timeout_s)
        self.timeout_s = timeout_s
        self.health_timeout_s = health_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s

    def next_prefill(self) -> str:
        return next(self._prefill)

    def next_decode(self) -> str:
        return next(self._decode)


def describe(role: str, url: str, e: BaseException, timeout_s: float, between: bool = False) -> str:
    """One sentence naming the engine (without credentials) and what went wrong, without aiohttp's
    internals. `between`: `timeout_s` was the longest silence allowed, not a total."""
    url = redact(url)
    if isinstance(e, aiohttp.ClientConnectorError):
        cause = e.os_error
        why = (
            "connection refused"
            if isinstance(cause, ConnectionRefusedError)
            else (cause.strerror or str(cause))
        )
        return f"{role} engine {url} is not reachable ({why.lower()})"
    if isinstance(e, asyncio.TimeoutError):
        return f"{role} engine {url} {'sent nothing for' if between else 'did not answer within'} {timeout_s:g} s"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return f"{role} engine {url} closed the connection before it answered"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"{role} engine {url} answered HTTP {e.status}"
    return f"{role} engine {url} failed ({type(e).__name__})"


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


async def _check_health(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url + "/health", timeout=timeout) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)


async def _healthy_decode(request: web.Request) -> str:
    """The next decode engine (round-robin) that answers its health check; BadGateway when none does."""
    config: ProxyConfig = request.app[CONFIG_KEY]
    problems = []
    for _ in config.decode_urls:
        url = config.next_decode()
        try:
            await _check_health(request.app[SESSION_KEY], url, config.health_timeout_s)
            return url
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            problems.append(describe("decode", url, e, config.health_timeout_s))
    raise BadGateway("; ".join(problems) + "; nothing was sent to a prefill engine")


async def _prefill(request: web.Request, path: str, body: dict) -> web.Response | None:
    """Run the prefill part; a response to pass on when the prefill engine refused the request."""
    config: ProxyConfig = request.app[CONFIG_KEY]
    problems = []
    for _ in config.prefill_urls:
        url = config.next_prefill()
        try:
            async with request.app[SESSION_KEY].post(url + path, json=prefill_request(body)) as resp:
                payload = await resp.read()
                if resp.status != 200:  # a bad request is bad for the decode engine too: pass it on
                    return web.Response(body=payload, status=resp.status, content_type="application/json")
                return None
        except aiohttp.ClientConnectorError as e:  # it never got the request: try the next one
            problems.append(describe("prefill", url, e, config.timeout_s, True))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise BadGateway(describe("prefill", url, e, config.timeout_s, True)) from None
    raise BadGateway("; ".join(problems))


async def _answer_begins(
    post: Any, role: str, url: str, first_byte_s: float | None, abandon: asyncio.Future | None
) -> aiohttp.ClientResponse:
    """The engine's response once its status line is in; EngineHung when `first_byte_s` passes first,
    or `abandon` is done first (the engine's health probe failed meanwhile)."""

    if first_byte_s is None and abandon is None:
        return await post

    async def begin() -> aiohttp.ClientResponse:
        return await post

    task = asyncio.ensure_future(begin())
    waits: set[asyncio.Future] = {task} if abandon is None else {task, abandon}
    try:
        await asyncio.wait(waits, timeout=first_byte_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():
        return task.result()  # or its ClientError / TimeoutError
    if abandon is not None and abandon.done():
        raise EngineHung(f"{role} engine {redact(url)} stopped answering its health probe before it answered")
    raise EngineHung(f"{role} engine {redact(url)} did not begin its answer within {first_byte_s:g} s")


async def forward(
    request: web.Request,
    path: str,
    body: dict | bytes,
    url: str,
    role: str = "decode",
    on_first_chunk: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    on_status: Callable[[int], None] | None = None,
    first_byte_s: float | None = None,
    abandon: asyncio.Future | None = None,
) -> web.StreamResponse:
    """Send `body` (a JSON object, or its bytes) to the engine at `url` and stream its answer back (the
    proxy's decode step and the router's only step). `on_status(status)` runs when the engine's status
    line arrives (before its body: a non-streamed answer's comes when it is complete);
    `on_first_chunk(status)` when the first bytes of the body arrive: for a streamed completion, its
    first token. `headers` are added to the response. Before the status line: EngineHung (nothing sent
    to the client yet) past `first_byte_s` or once `abandon` is done. After it, the config's timeout is
    the longest silence from the engine, and from our client (a write that does not drain closes it)."""
    config = request.app[CONFIG_KEY]  # ProxyConfig or RouterConfig: both have `timeout_s`
    out: web.StreamResponse | None = None
    data = (
        {"data": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    try:
        post = request.app[SESSION_KEY].post(url + path, **data)
        async with await _answer_begins(post, role, url, first_byte_s, abandon) as resp:
            if on_status is not None:
                on_status(resp.status)
            out = web.StreamResponse(status=resp.status)
            for k, v in resp.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    out.headers[k] = v
            out.headers.update(headers or {})
            await out.prepare(request)
            request[STREAM_KEY] = out
            async for chunk in resp.content.iter_any():
                if on_first_chunk is not None:
                    on_first_chunk(resp.status)
                    on_first_chunk = None
                if not await _write(request, out, chunk, config.timeout_s):
                    return out  # our client reads nothing: closed, and the engine's request with it
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError, asyncio.CancelledError) as e:
        if request.transport is None or request.transport.is_closing():
            raise  # our own client went away: closing the upstream request aborts it there
        if isinstance(e, asyncio.CancelledError):  # the drain at shutdown ran out of time
            message, status = "the proxy is shutting down", 503
        else:
            message, status = describe(role, url, e, config.timeout_s, True), 502
        if out is None:
            unreachable = isinstance(e, aiohttp.ClientConnectorError)
            raise (EngineUnreachable if unreachable else BadGateway)(message) from None
        logger.warning("%s %s: %s", request.method, request.path, message)
        if out.headers.get("Content-Type", "").startswith("text/event-stream"):
            error = json.dumps(error_body(status, message))
            await _write(
                request, out, f"event: error\ndata: {error}\n\ndata: [DONE]\n\n".encode(), config.timeout_s
            )
        await out.write_eof()
        if isinstance(e, asyncio.CancelledError):
            raise
        return out


async def _write(request: web.Request, out: web.StreamResponse, chunk: bytes, timeout_s: float) -> bool:
    """Write `chunk` to our client; False (and the connection aborted) when it has read nothing for
    `timeout_s` seconds (its buffers stayed full)."""
    try:
        await asyncio.wait_for(out.write(chunk), timeout_s)
        return True
    except asyncio.TimeoutError:
        logger.info(
            "%s %s: the client read nothing for %g s: closed", request.method, request.path, timeout_s
        )
        if request.transport is not None:
            request.transport.abort()
        return False


async def _handle(request: web.Request, path: str) -> web.StreamResponse:
    inflight = request.app[INFLIGHT_KEY]
    task = asyncio.current_task()
    inflight.add(task)
    try:
        raw = await read_body(request, request.app[DOOR_KEY].body_timeout_s)
        body = (
            parse_json(raw) if len(raw) <= _PARSE_ON_LOOP_BYTES else await asyncio.to_thread(parse_json, raw)
        )
        decode_url = await _healthy_decode(request)

        async def both() -> web.StreamResponse:
            refused = await _prefill(request, path, body)
            return refused if refused is not None else await forward(request, path, body, decode_url)

        return await unless_disconnected(request, both())
    finally:
        inflight.discard(task)


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
        raise BadGateway(describe("decode", url, e, config.timeout_s, True)) from None


async def health(request: web.Request) -> web.Response:
    config: ProxyConfig = request.app[CONFIG_KEY]
    urls = [*config.prefill_urls, *config.decode_urls]
    roles = ["prefill"] * len(config.prefill_urls) + ["decode"] * len(config.decode_urls)
    results = await asyncio.gather(
        *(_check_health(request.app[SESSION_KEY], u, config.health_timeout_s) for u in urls),
        return_exceptions=True,
    )
    down = [describe(role, u, r, config.health_timeout_s)
            for role, u, r in zip(roles, urls, results, strict=True) if isinstance(r, BaseException)]  # fmt: skip
    if down:
        return web.json_response(error_body(503, "; ".join(down)), status=503)
    return web.json_response({"status": "ok"})


def build_app(config: ProxyConfig, door: FrontDoor | None = None) -> web.Application:
    door = door or FrontDoor()
    guard = browser_guard(host_check(door.allowed_hosts, door.host))
    app = web.Application(middlewares=[errors_middleware, guard], client_max_size=MAX_BODY_BYTES)
    app[CONFIG_KEY] = config
    app[DOOR_KEY] = door
    app[MAX_BODY_KEY] = MAX_BODY_BYTES
    app[INFLIGHT_KEY] = set()

    async def on_startup(_: web.Application) -> None:
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=config.timeout)

    async def on_shutdown(_: web.Application) -> None:  # the listening socket is closed already
        inflight: set[asyncio.Task] = app[INFLIGHT_KEY]
        if inflight:
            logger.info(
                "shutdown: draining %d requests (up to %g s)", len(inflight), config.shutdown_timeout_s
            )
            _, late = await asyncio.wait(set(inflight), timeout=config.shutdown_timeout_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=5)

    async def on_cleanup(_: web.Application) -> None:
        await app[SESSION_KEY].close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="prefill engine URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode engine URL (repeatable)")
    p.add_argument("--health-timeout", type=float, default=2.0,
                   help="seconds a decode engine has to answer its health check before the prefill")  # fmt: skip
    add_front_door_args(p, 8200)


def run_proxy(ns: argparse.Namespace) -> None:
    config = ProxyConfig(ns.prefill, ns.decode, ns.timeout, ns.health_timeout, ns.shutdown_timeout)
    serve(
        build_app(config, front_door(ns)), ns.host, ns.port, "proxy", 5.0
    )  # 5 s after on_shutdown's drain: a backstop
