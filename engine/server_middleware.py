"""The OpenAI server's request plumbing (`kvstore-engine serve`, `router`, `proxy`): one JSON error shape
for every failure (aiohttp's own 404 / 405 / 413 included), safe JSON parsing, a body read within its
size limit and a deadline, noticing a client that hung up, and kvstore-server's cross-origin rules.

Cross-origin (`browser_guard`): what keeps a web page in a browser from using an engine or router
(running prompts on its GPU, reading the answers). These servers have no token, so kvstore-server's
token-less rules apply (kvstore.front_door.origin.HostCheck): a request's `Host` must be an IP address,
`localhost` or a name given to `--allowed-hosts` (`*` turns the check off), against DNS rebinding; an
`Origin` (only browsers send one) must be the server itself, loopback or an allowed name. A POST whose
Content-Type a page may send cross-origin without a CORS preflight (none, text/plain, a form) is refused
(415): OpenAI clients send application/json, and no answer here grants CORS, so a page's preflight for
that fails and the request is never sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web
from kvstore.engine.errors import EngineError, InvalidRequest, error_body
from kvstore.engine.streaming import STREAM_KEY

from kvstore.front_door.origin import HostCheck

logger = logging.getLogger(__name__)
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
MAX_BODY_BYTES = 8 * 2**20  # an engine's request body; the router and the proxy refuse above it too
ENGINE_HOST_HINT = "connect by IP address or localhost, or list the name in --allowed-hosts"
# What a page may send cross-origin with no preflight (Fetch standard, CORS-safelisted request header)
_SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
_DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client hung up before its answer was ready; its requests were aborted."""


def error_response(status: int, message: str, param: str | None = None, headers=None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if request.get(STREAM_KEY) is not None:
            return request[STREAM_KEY]
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, _http_message(request, e), headers=headers)
    except Exception as e:
        stream = request.get(STREAM_KEY)
        if stream is not None:  # it has its status line already: never a second response
            logger.info("%s %s: the stream ended early: %r", request.method, request.path, e)
            return stream
        return _json_error(request, e)


def _json_error(request: web.Request, e: Exception) -> web.StreamResponse:
    if isinstance(e, InvalidRequest):
        return error_response(e.status, str(e), e.param)
    if isinstance(e, ClientDisconnected):
        return web.Response(status=499)  # nobody reads it; nginx's "client closed request"
    if isinstance(e, EngineError):
        logger.warning("%s %s: %s", request.method, request.path, e)
        retry = getattr(e, "retry_after", None)  # a 503 for a moment's overload
        return error_response(
            getattr(e, "status", 500), str(e), headers={"Retry-After": str(retry)} if retry else None
        )
    logger.error("%s %s failed", request.method, request.path, exc_info=e)  # a bug: still JSON
    return error_response(500, f"internal error: {e!r}")


def hosts_list(value: str) -> list[str]:
    """`--allowed-hosts a,b`: the names."""
    return [h.strip() for h in value.split(",") if h.strip()]


def host_check(allowed_hosts: list[str] | tuple[str, ...] = (), bind_host: str = "") -> HostCheck:
    """kvstore-server's Host/Origin check with the engines' hint (`--allowed-hosts`)."""
    return HostCheck(allowed_hosts, bind_host, ENGINE_HOST_HINT)


def browser_guard(check: HostCheck):  # noqa: ANN201 (an aiohttp middleware)
    """The middleware refusing what a web page in a browser could send (the module docstring): 403 for
    a Host or Origin not allowed, 415 for a POST a page could send without a CORS preflight. It goes
    inside errors_middleware, so both are the engines' JSON errors."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        problem = check.problem(request)
        if problem is not None:
            return error_response(403, problem)
        if request.method == "POST":
            given = request.headers.get("Content-Type")
            kind = (given or "").partition(";")[0].strip().lower()
            if not kind or kind in _SIMPLE_TYPES:
                return error_response(
                    415, f"POST {request.path} takes Content-Type application/json, got {given!r:.60}"
                )
        return await handler(request)

    return guard


class BodyTimeout(InvalidRequest):
    status = 408


def check_length(request: web.Request) -> None:
    """413 when the declared Content-Length is over the app's limit (MAX_BODY_KEY)."""
    limit = request.app[MAX_BODY_KEY]
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body, within the app's size limit (MAX_BODY_KEY) and `timeout` seconds. A declared
    Content-Length over the limit is refused (413) before a byte of it is read; a chunked body at the
    limit (aiohttp's client_max_size); one that has not all arrived in `timeout` is a 408."""
    check_length(request)
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.path!r} on this server"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path} (allowed: {e.headers.get('Allow', '')})"
    if e.status == 413:
        return f"the request body is larger than this server's limit of {request.app[MAX_BODY_KEY]} bytes"
    return e.reason


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only a \uXXXX escape can make a lone surrogate


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("the request body nests JSON too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more than 4,300 digits
        raise InvalidRequest(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # a pair decodes to one code point; a lone half is not text
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidRequest(
                "the request body holds a lone UTF-16 surrogate (\\uD800-\\uDFFF) in a string"
            ) from None
    return body


async def _until_disconnected(request: web.Request) -> None:
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def unless_disconnected(request: web.Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client hangs up first, cancel it (its generators abort their requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled: let `work` wind down first
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected
    return task.result()
