"""The HTTP front door of the store operations (docs/design.md §6): each route reads its request off HTTP
(kvstore.protocol.ops: the route, the JSON names), calls the operation's handler (kvstore.server.handlers,
which the data plane calls too) and writes the answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from kvstore.server import handlers
from kvstore.server.body import read_blob, read_body, read_frame
from kvstore.server.state import BYTES_IN, BYTES_OUT, STATE, ServerState

from kvstore.errors import InvalidArgument
from kvstore.keys import validate_key
from kvstore.protocol import ops, wire

routes = web.RouteTableDef()


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


_WIRE_HEADERS = {wire.WIRE_VERSION_HEADER: wire.WIRE_VERSION}
_SMALL = 64 * 1024


async def send_buffers(request: web.Request, parts: list, content_type: str) -> web.StreamResponse:
    """Send `parts` back to back as the body. Large bodies go out as the headers, then each buffer as
    is: aiohttp's Response would join headers and body into one new bytes first (a full copy).

    A large body holds its blobs until the client has read it (an evicted blob stays in memory while a
    slow reader takes it), so it is charged to the body budget (Busy before anything is sent) and must
    be read within body_timeout, or the connection is closed."""
    total = sum(memoryview(p).nbytes for p in parts)
    request[BYTES_OUT] = total
    if total <= _SMALL:
        return web.Response(body=b"".join(parts), content_type=content_type, headers=_WIRE_HEADERS)
    st = _state(request)
    st.budget.reserve(request, total)
    resp = web.StreamResponse(headers=_WIRE_HEADERS)
    resp.content_type = content_type
    resp.content_length = total
    await resp.prepare(request)
    try:
        await asyncio.wait_for(_write_all(resp, parts), st.config.body_timeout)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.close()
        raise ConnectionResetError(
            f"the client did not read {total} bytes within {st.config.body_timeout:g} s"
        ) from None
    return resp


async def _write_all(resp: web.StreamResponse, parts: list) -> None:
    for part in parts:
        await resp.write(part)
    await resp.write_eof()


# -- one key: in the path (kvstore.protocol.ops: each operation's `one` route) ---------------------------


@routes.put(ops.PUT.one.path, name=ops.PUT.one.name)
async def put_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    body = await read_blob(
        request, st.store_config.max_blob_size, st.config.body_timeout, wire.BLOB_CONTENT_TYPE
    )
    request[BYTES_IN] = len(body)
    answer = await st.call(handlers.put, st, ops.PutRequest([key], [len(body)], blobs=[body]))
    return web.Response(
        status=201, headers={**_WIRE_HEADERS, wire.STORED_IN_HEADER: ",".join(answer.stored_in[0])}
    )


@routes.get(ops.GET.one.path, name=ops.GET.one.name, allow_head=False)  # HEAD has its own handler
async def get_chunk(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    answer = await st.call(handlers.get, st, ops.KeysRequest([key]))
    if not answer.found():
        reason = answer.reasons[0] if answer.reasons else None
        body = {"error": f"no chunk {key}", "type": "NotFound", "reason": reason}
        return web.json_response(body, status=404, headers={wire.MISS_REASON_HEADER: str(reason)})
    return await send_buffers(request, answer.blobs, wire.BLOB_CONTENT_TYPE)


@routes.head(ops.EXISTS.one.path, name=ops.EXISTS.one.name)
async def head_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    answer = await st.call(handlers.exists, st, ops.KeysRequest([validate_key(request.match_info["key"])]))
    if not answer.found():
        return web.Response(status=404)  # HEAD responses carry no body, not even a JSON error
    return web.Response(status=200, headers=_WIRE_HEADERS)


@routes.delete(ops.DELETE.one.path, name=ops.DELETE.one.name)
async def delete_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    if not (await st.call(handlers.delete, st, ops.KeysRequest([key]))).found():
        raise web.HTTPNotFound(text=f"no chunk {key}")
    return web.Response(status=204)


# -- batches: a JSON body or a batch frame ---------------------------------------------------------------


async def _json_body(request: web.Request) -> Any:
    st = _state(request)
    limit = min(st.config.max_request_size, 1 << 24)
    body = await read_body(request, limit, st.config.body_timeout, wire.JSON_CONTENT_TYPE)
    request[BYTES_IN] = len(body)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the interpreter's stack
        raise InvalidArgument('body must be JSON {"keys": [...]}') from None
    return data


@routes.post(ops.GET.batch.path, name=ops.GET.batch.name)
async def batch_get(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    req = ops.request_from(ops.GET, await _json_body(request), ops.HTTP)
    answer = await st.call(handlers.get, st, req)
    reasons = answer.reasons or [None] * len(req.keys)
    return await send_buffers(
        request, wire.encode_frame(req.keys, answer.blobs, reasons), wire.BATCH_CONTENT_TYPE
    )


@routes.post(ops.PUT.batch.path, name=ops.PUT.batch.name)
async def batch_put(request: web.Request) -> web.Response:
    st = _state(request)
    header, blobs = await read_frame(
        request, st.config.max_request_size, st.store_config.max_blob_size, st.config.body_timeout
    )
    request[BYTES_IN] = sum(len(b) for b in blobs)
    lens = [len(b) for b in blobs]  # the request's other fields (token hints) are in the frame's header
    req = ops.request_from(ops.PUT, header.fields, ops.HTTP, keys=header.keys, lens=lens, blobs=blobs)
    answer = await st.call(handlers.put, st, req)
    return web.json_response(ops.to_wire(ops.PUT.answer, answer, ops.HTTP), status=201)


def _json_op(op: ops.Op) -> Any:
    """The batch route of an operation whose request and answer are JSON: read, handled, written."""

    async def route(request: web.Request) -> web.Response:
        st = _state(request)
        req = ops.request_from(op, await _json_body(request), ops.HTTP)
        answer = await st.call(handlers.HANDLERS[op.name], st, req)
        return web.json_response(ops.to_wire(op.answer, answer, ops.HTTP))

    return route


for _op in (ops.EXISTS, ops.DELETE, ops.LOOKUP):
    routes.post(_op.batch.path, name=_op.batch.name)(_json_op(_op))
