"""What the server and the SDK agree on (docs/design.md §6): routes, headers, batch framing, errors.

Single chunks travel as the raw blob bytes (`application/octet-stream`). Requests that only carry keys
(batch get, batch exists, lookup) are JSON `{"keys": [...]}`. Anything carrying several blobs uses the
batch frame, all little-endian:

    offset  size  field
    0       4     magic b"KVB1"
    4       4     header length H (uint32)
    8       H     msgpack map: {"keys": [str, ...], "lens": [int, ...]}  (a len of -1 marks a miss;
                  a batch get answer adds "reasons": [str | None, ...], why each miss missed)
    8+H     ...   the payloads, concatenated in key order, no padding

A frame's total length is exactly 8 + H + sum(len >= 0); anything else is malformed. Errors are JSON
`{"error": "<message>", "type": "<exception class name>"}` with the status of that exception class.

Acknowledgements say what was stored: a 201 for one chunk names the tiers holding it in
`X-KVStore-Stored-In` (e.g. `cpu,disk`); a batch put answers `{"stored": N, "stored_in": [[tier, ...],
...]}` in key order. A put no tier stored is an error (507 NotStored, 503 Unavailable, 413 TooLarge);
a batch error body adds the same `stored_in` list, so a client knows which blobs did land.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvstore import errors
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import validate_key

API_PREFIX = "/v1"
CHUNKS_PATH = API_PREFIX + "/chunks"
BATCH_GET_PATH = API_PREFIX + "/batch/get"
BATCH_PUT_PATH = API_PREFIX + "/batch/put"
BATCH_EXISTS_PATH = API_PREFIX + "/batch/exists"
BATCH_DELETE_PATH = API_PREFIX + "/batch/delete"
LOOKUP_PATH = API_PREFIX + "/lookup"
STATS_PATH = API_PREFIX + "/stats"
HISTORY_PATH = API_PREFIX + "/stats/history"

BLOB_CONTENT_TYPE = "application/octet-stream"
BATCH_CONTENT_TYPE = "application/x-kvstore-batch"
JSON_CONTENT_TYPE = "application/json"
WIRE_VERSION_HEADER = "X-KVStore-Wire"
STORED_IN_HEADER = "X-KVStore-Stored-In"  # on a 201 for one chunk: the tiers holding it, comma-separated
WIRE_VERSION = "1"
MISS_REASON_HEADER = "X-KVStore-Miss-Reason"  # on a 404 from GET /v1/chunks/{key} (kvstore/miss_log.py)
MAX_BATCH_KEYS = 4096

FRAME_MAGIC = b"KVB1"
_PREAMBLE = struct.Struct("<4sI")
PREAMBLE_SIZE = _PREAMBLE.size
MAX_FRAME_HEADER = 1 << 20
MISSING = -1


def chunk_path(key: str) -> str:
    return f"{CHUNKS_PATH}/{key}"


# --- batch frames -----------------------------------------------------------------------------------


def frame_header(
    keys: Sequence[str],
    lens: Sequence[int],
    reasons: Sequence[str | None] | None = None,
    more: dict[str, Any] | None = None,
) -> bytes:
    """The preamble + msgpack header of a frame; the payloads follow it on the wire. `more`: a
    request's other fields (kvstore.protocol.ops: a put's token hints), in the header beside `keys`."""
    assert len(keys) == len(lens)
    fields: dict[str, Any] = {**(more or {}), "keys": list(keys), "lens": list(lens)}
    if reasons is not None:
        assert len(reasons) == len(keys)
        fields["reasons"] = list(reasons)
    head = msgpack.packb(fields)
    return _PREAMBLE.pack(FRAME_MAGIC, len(head)) + head


def encode_frame(
    keys: Sequence[str],
    blobs: Sequence[bytes | bytearray | memoryview | None],
    reasons: Sequence[str | None] | None = None,
) -> list:
    """A frame as a list of buffers (header first, then each present blob) to write without joining."""
    lens = [MISSING if b is None else memoryview(b).nbytes for b in blobs]
    return [frame_header(keys, lens, reasons), *(b for b in blobs if b is not None)]


def parse_preamble(data: bytes | bytearray | memoryview) -> int:
    """Header length H from the first 8 bytes of a frame."""
    if len(data) < PREAMBLE_SIZE:
        raise InvalidArgument(f"batch frame of {len(data)} bytes is shorter than its preamble")
    magic, hlen = _PREAMBLE.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise InvalidArgument("bad batch frame magic (expected b'KVB1')")
    if hlen > MAX_FRAME_HEADER:
        raise InvalidArgument(f"batch frame header of {hlen} bytes is over {MAX_FRAME_HEADER}")
    return hlen


@dataclass(frozen=True)
class FrameHeader:
    keys: list[str]
    lens: list[int]
    payload_offset: int  # where the first payload starts, counted from the frame's first byte
    reasons: list[str | None] | None = None  # why each miss missed (batch get answers)
    fields: dict[str, Any] = field(default_factory=dict)  # the whole header: a request's other fields

    @property
    def payload_bytes(self) -> int:
        return sum(n for n in self.lens if n > 0)

    def spans(self) -> list[tuple[int, int] | None]:
        """(start, end) of each payload in the frame, None for a miss."""
        out: list[tuple[int, int] | None] = []
        pos = self.payload_offset
        for n in self.lens:
            if n < 0:
                out.append(None)
            else:
                out.append((pos, pos + n))
                pos += n
        return out


def parse_frame_header(data: bytes | bytearray | memoryview, allow_missing: bool = False) -> FrameHeader:
    """Parse and check the preamble + header; payload lengths are not checked against the data here."""
    hlen = parse_preamble(data)
    if len(data) < PREAMBLE_SIZE + hlen:
        raise InvalidArgument("batch frame is shorter than its header")
    try:
        head = msgpack.unpackb(memoryview(data)[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen])
    except Exception as e:  # msgpack raises many unrelated types on garbage
        raise InvalidArgument(f"batch frame header is not msgpack: {type(e).__name__}") from None
    if (
        not isinstance(head, dict)
        or not isinstance(head.get("keys"), list)
        or not isinstance(head.get("lens"), list)
    ):
        raise InvalidArgument("batch frame header must be a map with 'keys' and 'lens' lists")
    keys, lens = head["keys"], head["lens"]
    if len(keys) != len(lens):
        raise InvalidArgument(f"batch frame has {len(keys)} keys but {len(lens)} lengths")
    if len(keys) > MAX_BATCH_KEYS:
        raise InvalidArgument(f"batch of {len(keys)} keys is over {MAX_BATCH_KEYS}")
    for key in keys:
        validate_key(key)
    lowest = MISSING if allow_missing else 0
    if not all(type(n) is int and n >= lowest for n in lens):
        raise InvalidArgument("batch frame lengths must be non-negative integers")
    reasons = head.get("reasons")
    if not (isinstance(reasons, list) and len(reasons) == len(keys)):
        reasons = None  # optional and informative only: a malformed list is ignored, never an error
    return FrameHeader(keys, lens, PREAMBLE_SIZE + hlen, reasons, head)


def decode_frame(
    data: bytes | bytearray | memoryview, allow_missing: bool = False
) -> tuple[list[str], list[memoryview | None]]:
    """Split a whole frame into keys and zero-copy payload views; raise InvalidArgument if malformed."""
    header = parse_frame_header(data, allow_missing)
    view = memoryview(data).cast("B")
    if header.payload_offset + header.payload_bytes != len(view):
        raise InvalidArgument(
            f"batch frame is {len(view)} bytes but its header describes "
            f"{header.payload_offset + header.payload_bytes}"
        )
    return header.keys, [None if s is None else view[s[0] : s[1]] for s in header.spans()]


def parse_keys(body: Any) -> list[str]:
    """Validate the JSON body `{"keys": [...]}` of a keys-only request."""
    if not isinstance(body, dict) or not isinstance(body.get("keys"), list):
        raise InvalidArgument('expected a JSON object {"keys": [hex key, ...]}')
    keys = body["keys"]
    if len(keys) > MAX_BATCH_KEYS:
        raise InvalidArgument(f"batch of {len(keys)} keys is over {MAX_BATCH_KEYS}")
    for key in keys:
        validate_key(key)
    return keys


# --- errors -----------------------------------------------------------------------------------------

ERROR_TYPES: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, KVStoreError)
}


def error_body(exc: KVStoreError | str, type_name: str | None = None) -> dict[str, str]:
    """The JSON body of an error response."""
    if isinstance(exc, KVStoreError):
        return {"error": str(exc), "type": type_name or type(exc).__name__}
    return {"error": exc, "type": type_name or "KVStoreError"}


def error_from_response(status: int, body: bytes | str | None) -> KVStoreError:
    """Rebuild the typed exception a server sent; unknown or unparsable bodies map by status code."""
    import json  # noqa: PLC0415 (cold path)

    message, type_name, stored_in = f"HTTP {status}", None, None
    if body:
        try:
            data = json.loads(body)
            message, type_name = str(data.get("error", message)), data.get("type")
            stored_in = data.get("stored_in")
        except (ValueError, AttributeError):
            text = body.decode(errors="replace") if isinstance(body, bytes) else body
            message = f"HTTP {status}: {text[:200]}"
    cls = ERROR_TYPES.get(type_name or "")
    if cls is None:
        cls = _BY_STATUS.get(status, KVStoreError if status < 500 else errors.Unavailable)
    exc = cls(message)
    exc.status = status  # the status the server actually sent, e.g. 405 for an InvalidArgument
    if isinstance(stored_in, list):  # a failed batch put: which blobs did land, and where
        exc.stored_in = stored_in  # type: ignore[attr-defined]
    return exc


_BY_STATUS: dict[int, type[KVStoreError]] = {
    400: InvalidArgument,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    405: InvalidArgument,
    408: InvalidArgument,
    411: InvalidArgument,
    413: errors.TooLarge,
    415: errors.UnsupportedMediaType,
    422: errors.CorruptBlob,
    502: errors.Unavailable,
    503: errors.Unavailable,
    504: errors.Unavailable,
    507: errors.NotStored,
}
