"""Middlewares: JSON errors for everything, bearer-token auth, request metrics."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import hdrs, web
from kvstore.server.metrics import ServerMetrics
from kvstore.server.state import BYTES_IN, BYTES_OUT, STATE

from kvstore.errors import Busy, InvalidArgument, KVStoreError, Unauthorized
from kvstore.front_door.origin import HostCheck
from kvstore.protocol import wire

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/healthz", "/dashboard", "/"})  # no data behind them
_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed", 411: "InvalidArgument", 413: "TooLarge"}


def json_error(
    status: int, message: str, type_name: str, headers: dict[str, str] | None = None, **extra: object
) -> web.Response:
    body = json.dumps({"error": message, "type": type_name, **extra}).encode()
    resp = web.Response(status=status, body=body, content_type=wire.JSON_CONTENT_TYPE, headers=headers)
    return resp


def error_response(exc: BaseException, request: web.BaseRequest | None = None) -> web.Response:
    """The JSON response for any exception a handler raised. Only a bug in the server gives a 500."""
    if isinstance(exc, KVStoreError):
        headers = {"WWW-Authenticate": 'Bearer realm="kvstore"'} if isinstance(exc, Unauthorized) else None
        if isinstance(exc, Busy):
            headers = {"Retry-After": str(exc.retry_after)}
        extra = {"stored_in": exc.stored_in} if hasattr(exc, "stored_in") else {}  # a failed batch put
        resp = json_error(exc.status, str(exc), type(exc).__name__, headers, **extra)
    elif isinstance(exc, web.HTTPException):
        type_name = _HTTP_TYPES.get(exc.status, "InvalidArgument" if exc.status < 500 else "KVStoreError")
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        message = exc.text or exc.reason
        if exc.status == 404 and message == "404: Not Found" and request is not None:
            message = f"no such route: {request.method} {request.path}"
        if isinstance(exc, web.HTTPMethodNotAllowed):
            message = f"{exc.method} is not allowed here; allowed: {', '.join(sorted(exc.allowed_methods))}"
        resp = json_error(exc.status, message, type_name, headers)
    elif isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError)):
        resp = json_error(400, f"malformed request body: {exc}", "InvalidArgument")
    else:
        log.exception("unexpected error while serving a request", exc_info=exc)
        resp = json_error(500, f"internal error: {type(exc).__name__}", "KVStoreError")
    # An unread request body is left to aiohttp: it reads and drops it for up to `lingering_time`, so a
    # client still sending gets this answer instead of a reset, then closes the connection if it must.
    return resp


def bearer_credentials(authorization: bytes) -> bytes:
    """The credentials of a `Bearer` Authorization header, b"" for any other scheme. The scheme is
    case-insensitive and one or more spaces follow it (RFC 9110, section 11: `bearer x` is `Bearer x`)."""
    scheme, _, rest = authorization.partition(b" ")
    return rest.lstrip(b" ") if scheme.lower() == b"bearer" else b""


def check_transfer_coding(request: web.BaseRequest) -> None:
    """Only `Transfer-Encoding: chunked` is understood. aiohttp de-chunks any list that ends with
    chunked and ignores the codings before it (`identity, chunked`, `gzip, chunked`), handing the
    handler bytes the client did not mean; RFC 9112 (section 6.1): a server that receives a transfer
    coding it does not understand SHOULD answer 501 (Not Implemented)."""
    codings = [
        c.strip().lower() for v in request.headers.getall(hdrs.TRANSFER_ENCODING) for c in v.split(",")
    ]
    if codings != ["chunked"]:
        e = InvalidArgument("only 'Transfer-Encoding: chunked' is implemented (or send Content-Length)")
        e.status = 501
        raise e


def make_middlewares(
    token: str | None, metrics: ServerMetrics, metrics_auth: bool, host_check: HostCheck | None = None
) -> list:
    """One middleware doing auth (or, without a token, the Host check), JSON errors and metrics: each
    layer of aiohttp middleware costs a coroutine per request, which shows at thousands of small
    requests per second."""
    expected = token.encode() if token else None
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
    if expected is None and host_check is None:
        host_check = HostCheck(())

    @web.middleware
    async def serve(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        metrics.in_flight += 1
        status = 500
        try:
            if hdrs.TRANSFER_ENCODING in request.headers:
                check_transfer_coding(request)
            if expected is None:
                host_check.check(request)  # type: ignore[union-attr]
            elif request.path not in open_paths:
                # the header's own bytes: aiohttp decodes non-UTF-8 bytes to surrogates, which .encode() refuses
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(bearer_credentials(given), expected):
                    raise Unauthorized("missing bearer token" if not given else "wrong bearer token")
            resp = await handler(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise  # the client is gone; there is nobody to answer
        except web.HTTPException as e:
            if e.status < 400:
                status = e.status
                raise  # redirects are answers, not errors
            resp = error_response(e, request)
        except Exception as e:  # every error becomes JSON; a non-KVStoreError one is logged as a bug
            resp = error_response(e)
        finally:
            metrics.in_flight -= 1
            request.app[STATE].budget.release(request)  # the body's bytes are a tier's now, or garbage
        status = resp.status
        op = request.match_info.route.name or "unmatched"
        metrics.observe(
            op, status, time.perf_counter() - start, request.get(BYTES_IN, 0), request.get(BYTES_OUT, 0)
        )
        return resp

    return [serve]
