"""The OpenAI server's request plumbing: one JSON error shape for every failure (aiohttp's own 404 /
405 / 413 included), safe JSON parsing, and noticing a client that hung up."""

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

logger = logging.getLogger(__name__)
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
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
        return error_response(getattr(e, "status", 500), str(e))
    logger.error("%s %s failed", request.method, request.path, exc_info=e)  # a bug: still JSON
    return error_response(500, f"internal error: {e!r}")


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
