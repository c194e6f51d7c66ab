"""Reading a request body whole, within a size limit, the in-flight budget (server/budget.py) and a
deadline.

A blob lands in one buffer allocated from its declared length (Content-Length, or its length in a
batch frame): aiohttp's parser hands the body over in chunks, and each is copied straight into place
instead of being kept and joined (which held the body twice). The buffer goes to the store as a
read-only view that nothing writes any more, so the tier keeps it without another copy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from aiohttp import web
from kvstore.server.state import STATE

from kvstore.errors import InvalidArgument, TooLarge, UnsupportedMediaType
from kvstore.front_door.budget import BodyBudget
from kvstore.protocol import wire


def check_content_type(request: web.BaseRequest, expected: str) -> None:
    """A data route's body must be declared as its own type, or come with the X-KVStore-Wire header:
    a browser can send neither cross-origin without a CORS preflight, and the server grants none."""
    if wire.WIRE_VERSION_HEADER in request.headers:
        return
    given = request.headers.get("Content-Type")
    if given is None or given.partition(";")[0].strip().lower() != expected:
        raise UnsupportedMediaType(
            f"{request.method} {request.path} takes Content-Type {expected} "
            f"(or the {wire.WIRE_VERSION_HEADER} header), got {given!r:.60}"
        )


def declared_length(request: web.BaseRequest, limit: int) -> int | None:
    """The Content-Length, checked against `limit` before a byte of the body is read."""
    if request.content_length is None:
        return None
    if request.content_length > limit:
        raise TooLarge(f"body of {request.content_length} bytes is over the {limit}-byte limit")
    return request.content_length


def _budget(request: web.BaseRequest) -> BodyBudget:
    return request.app[STATE].budget


async def read_body(request: web.BaseRequest, limit: int, timeout: float, content_type: str) -> bytes:
    """The whole body, or InvalidArgument (truncated / stalled) or TooLarge. Never a partial body."""
    check_content_type(request, content_type)
    expected = declared_length(request, limit)
    if expected is not None:  # Busy (503) when too much is in flight; the join below holds it twice
        _budget(request).reserve(request, 2 * expected)
    try:
        return await asyncio.wait_for(_read(request, expected, limit), timeout)
    except asyncio.TimeoutError:
        raise InvalidArgument(
            f"truncated body: not all of the declared {expected} bytes arrived within {timeout:g} s"
            if expected is not None
            else f"body did not finish within {timeout:g} s"
        ) from None


async def _read(request: web.BaseRequest, expected: int | None, limit: int) -> bytes:
    # Chunks joined once into `bytes`: the one copy, and a type tiers keep without copying again.
    stream = request.content
    chunks: list[bytes] = []
    size = 0
    cap = limit if expected is None else expected
    while True:
        chunk = await stream.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > cap:  # only a chunked body can get here: the parser stops at Content-Length
            raise TooLarge(f"chunked body is over the {limit}-byte limit")
        if expected is None:
            _budget(request).reserve(request, 2 * len(chunk))
        chunks.append(chunk)
    if expected is not None and size != expected:
        raise InvalidArgument(f"truncated body: {size} of the declared {expected} bytes")
    return b"".join(chunks)


async def read_blob(request: web.BaseRequest, limit: int, timeout: float, content_type: str) -> memoryview:
    """A single blob's body in one buffer sized from Content-Length (read_body's rules otherwise)."""
    check_content_type(request, content_type)
    expected = declared_length(request, limit)
    if expected is None:  # chunked: the length is not known up front
        return memoryview(await read_body(request, limit, timeout, content_type))
    _budget(request).reserve(request, expected)  # Busy (503) when too much is in flight
    try:
        return await asyncio.wait_for(_read_into(request.content, expected, "truncated body", True), timeout)
    except asyncio.TimeoutError:
        raise InvalidArgument(
            f"truncated body: not all of the declared {expected} bytes arrived within {timeout:g} s"
        ) from None


async def _read_into(stream: Any, n: int, what: str, whole: bool = False) -> memoryview:
    """Exactly `n` bytes into one new buffer (not zeroed first: every byte is written), read-only;
    `whole`: they are the whole body (aiohttp ends the payload at Content-Length, so this is a check)."""
    view = memoryview(np.empty(n, np.uint8))
    got = 0
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:
            raise InvalidArgument(f"{what}: {got} of the declared {n} bytes")
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    if whole and await stream.read(1):
        raise InvalidArgument("body is longer than its Content-Length")
    return view.toreadonly()


async def read_frame(
    request: web.BaseRequest, limit: int, blob_limit: int, timeout: float
) -> tuple[wire.FrameHeader, list[memoryview]]:
    """A batch frame (kvstore.protocol.wire) read into one buffer per blob, so that a stored blob never pins
    the memory of the whole request. Any malformation raises before a blob is returned."""
    check_content_type(request, wire.BATCH_CONTENT_TYPE)
    expected = declared_length(request, limit)
    try:
        return await asyncio.wait_for(_read_frame(request, expected, limit, blob_limit), timeout)
    except asyncio.TimeoutError:
        raise InvalidArgument(f"truncated batch body: it did not arrive within {timeout:g} s") from None


async def _read_exactly(stream: Any, n: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < n:
        chunk = await stream.read(n - size)
        if not chunk:
            raise InvalidArgument(f"truncated batch body: a part ended after {size} of {n} bytes")
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def _read_frame(
    request: web.BaseRequest, expected: int | None, limit: int, blob_limit: int
) -> tuple[wire.FrameHeader, list[memoryview]]:
    stream = request.content
    preamble = await _read_exactly(stream, wire.PREAMBLE_SIZE)
    hlen = wire.parse_preamble(preamble)
    header = wire.parse_frame_header(preamble + await _read_exactly(stream, hlen))
    total = header.payload_offset + header.payload_bytes
    if expected is not None and total != expected:
        raise InvalidArgument(f"batch frame describes {total} bytes but Content-Length is {expected}")
    if total > limit:
        raise TooLarge(f"batch of {total} bytes is over the {limit}-byte limit")
    for key, n in zip(header.keys, header.lens, strict=True):
        if n > blob_limit:
            raise TooLarge(f"blob for {key} is {n} bytes, over the {blob_limit}-byte limit")
    _budget(request).reserve(request, total)  # Busy (503) when too much is in flight: the blobs
    blobs = [await _read_into(stream, n, "truncated batch body") for n in header.lens]
    if expected is None and await stream.read(1):
        raise InvalidArgument("batch body is longer than its frame")
    return header, blobs
