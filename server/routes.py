"""The data-plane handlers: single chunks, batches, prefix lookup (docs/design.md §6)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from kvstore.server.body import read_blob, read_body, read_frame
from kvstore.server.state import BYTES_IN, BYTES_OUT, STATE, ServerState

from kvstore.errors import InvalidArgument
from kvstore.keys import validate_key
from kvstore.protocol import wire

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


@routes.put(wire.CHUNKS_PATH + "/{key}", name="put")
async def put_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    body = await read_blob(
        request, st.store_config.max_blob_size, st.config.body_timeout, wire.BLOB_CONTENT_TYPE
    )
    request[BYTES_IN] = len(body)
    # The store verifies the blob (CorruptBlob -> 422) and its size before storing anything, and
    # raises (507, 503...) when no tier stored it: a 201 says where it is.
    tiers = await st.call(st.store.put_blob, key, body)
    return web.Response(status=201, headers={**_WIRE_HEADERS, wire.STORED_IN_HEADER: ",".join(tiers)})


@routes.get(wire.CHUNKS_PATH + "/{key}", name="get", allow_head=False)  # HEAD has its own handler
async def get_chunk(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    reasons: list[str | None] = []
    blob = await st.call(st.store.get_blob, key, reasons)
    if blob is None:
        body = {"error": f"no chunk {key}", "type": "NotFound", "reason": reasons[0]}
        return web.json_response(body, status=404, headers={wire.MISS_REASON_HEADER: str(reasons[0])})
    return await send_buffers(request, [blob], wire.BLOB_CONTENT_TYPE)


@routes.head(wire.CHUNKS_PATH + "/{key}", name="head")
async def head_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    if not await st.call(st.store.exists, key):
        return web.Response(status=404)  # HEAD responses carry no body, not even a JSON error
    return web.Response(status=200, headers=_WIRE_HEADERS)


@routes.delete(wire.CHUNKS_PATH + "/{key}", name="delete")
async def delete_chunk(request: web.Request) -> web.Response:
    st = _state(request)
    key = validate_key(request.match_info["key"])
    if not await st.call(st.store.delete, key):
        raise web.HTTPNotFound(text=f"no chunk {key}")
    return web.Response(status=204)


async def _json_keys(request: web.Request) -> list[str]:
    return wire.parse_keys(await _json_body(request))


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


@routes.post(wire.BATCH_GET_PATH, name="batch_get")
async def batch_get(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    keys = await _json_keys(request)
    reasons: list[str | None] = []
    blobs = await st.call(st.store.batch_get, keys, reasons)
    return await send_buffers(request, wire.encode_frame(keys, blobs, reasons), wire.BATCH_CONTENT_TYPE)


@routes.post(wire.BATCH_PUT_PATH, name="batch_put")
async def batch_put(request: web.Request) -> web.Response:
    st = _state(request)
    keys, blobs = await read_frame(
        request, st.config.max_request_size, st.store_config.max_blob_size, st.config.body_timeout
    )
    request[BYTES_IN] = sum(len(b) for b in blobs)
    # The store verifies every blob before it stores the first one: a bad batch stores nothing.
    stored_in = await st.call(st.store.batch_put, list(zip(keys, blobs, strict=True)))
    return web.json_response({"stored": len(keys), "stored_in": stored_in}, status=201)


@routes.post(wire.BATCH_EXISTS_PATH, name="batch_exists")
async def batch_exists(request: web.Request) -> web.Response:
    st = _state(request)
    keys = await _json_keys(request)
    found = await st.call(st.store.batch_exists, keys)
    return web.json_response({"exists": [bool(f) for f in found]})


@routes.post(wire.BATCH_DELETE_PATH, name="batch_delete")
async def batch_delete(request: web.Request) -> web.Response:
    st = _state(request)
    keys = await _json_keys(request)
    deleted = await st.call(lambda: sum(bool(st.store.delete(k)) for k in keys))
    return web.json_response({"deleted": deleted})


@routes.post(wire.LOOKUP_PATH, name="lookup")
async def lookup(request: web.Request) -> web.Response:
    """The number of leading keys that are present (Spec 1: the first gap ends the prefix), and why the
    next one is not (`miss`: not_stored, evicted, expired, corrupt, unreachable; null when all are).
    With `also` in the body, whether each of those keys is stored too (in the same order): a client
    asks for a prefix and the candidates after it in one round trip."""
    st = _state(request)
    data = await _json_body(request)
    keys = wire.parse_keys(data)
    n, reason = await st.call(st.store.lookup, keys)
    st.metrics.count_lookup(n, len(keys))
    answer = {"prefix": int(n), "keys": len(keys), "miss": reason}
    if "also" in data:
        others = wire.parse_keys({"keys": data["also"]})
        answer["also"] = [bool(f) for f in await st.call(st.store.batch_exists, others)]
    return web.json_response(answer)
