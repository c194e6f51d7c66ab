"""The binary data plane: what the server and the SDK agree on besides HTTP (docs/design.md §7).

HTTP stays the public API. An SDK client may instead open its connection to the same port with the
8-byte `PREFACE` (its first byte, 0x89, never starts an HTTP request, so the server tells the two apart
by one byte) and then speak lean request/response messages, one at a time per connection:

    offset  size  field (little-endian)
    0       1     op (HELLO, GET, PUT, ...)
    1       1     flags (FLAG_SHM: the payloads are in a shared-memory segment, not on the socket;
                  FLAG_CLOSE, in a response: the server closes the connection after it)
    2       2     status: 0 in requests; the HTTP status of the answer in responses (200, 404, 413...)
    4       4     meta length M (msgpack map, at most MAX_META bytes)
    8       8     body length B (the payloads, concatenated, on the socket)
    16      M     meta
    16+M    B     body

Request metas: `k` the keys; PUT adds `l` (blob lengths) and may add `x`: keys the new blobs
supersede, deleted only once every blob is stored (answered `x`: whether each was deleted; a server
that does not answer `x` deleted nothing, and the client deletes them itself); with FLAG_SHM a put or get names its
region `s` = [segment id, offset, capacity] instead of carrying bytes on the socket. A FLAG_SHM get
may add `a`, the nonce of the server's arena (HELLO's `arena` = [path, size, nonce]: the cpu tier's
blobs, kvstore.tiers.arena) that the client has mapped read-only: when every hit lies there, the
server lends them instead of copying, answering `a` (each blob's offset in the arena, -1 for a miss)
and `p`, a pin id. Lent blobs keep their place until the client lists the pin in `u` of a later
FLAG_SHM request naming the same segment, or the segment closes. Response metas:
GET `l` (lengths, -1 for a miss) and, with FLAG_SHM, `o` (where the first blob starts); EXISTS `e`;
DELETE `d`; LOOKUP `n`; PUT whatever the HTTP route answers; errors `error` and `type` as in
`kvstore.protocol.wire` (the status field carries the HTTP status; a 503 Busy adds `retry_after`).

HELLO may also answer `index` = [path, size, nonce, slots, seed]: a table of where each arena blob
lies (kvstore.protocol.arena_table), offered when the arena's tier is the store's top tier, on x86-64 only
(its readers rely on TSO; a client elsewhere does not read it either). A client that
mapped it reads such blobs without a request and later sends TOUCH `k` (the keys it read) and `g`
([number of keys, seconds] of each get, in the order of `k`), which is never answered: the server
counts the gets whose keys its index publishes, on a connection whose HELLO lent the index, as hits
of the top tier (their recency refreshed) and as reported gets (kvstore_reported_gets, seconds at most
the time since that HELLO), apart from the requests it measured; other keys are ignored. The first
message must be HELLO (token, wire version); anything else, or a wrong token, is answered with 401
and the connection closes. The server's limits are the HTTP side's: sizes, the body budget, the
connection limit, and the idle / header / body deadlines.

Same-host shared memory (SHM_OPEN / SHM_ATTACH) is described in `kvstore.protocol.shm`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import validate_key
from kvstore.protocol.wire import ERROR_TYPES, MAX_BATCH_KEYS

PREFACE = b"\x89KVD\r\n\x1a\n"
PREFACE_FIRST_BYTE = PREFACE[0]
VERSION = 1
_HEAD = struct.Struct("<BBHIQ")
HEAD_SIZE = _HEAD.size
assert HEAD_SIZE == 16
MAX_META = 1 << 20
MISSING = -1
MAX_PINS = 4096

HELLO, GET, PUT, EXISTS, DELETE, LOOKUP, SHM_OPEN, SHM_ATTACH, TOUCH = range(1, 10)
OP_NAMES = {
    HELLO: "hello", GET: "get", PUT: "put", EXISTS: "exists", DELETE: "delete", LOOKUP: "lookup",
    SHM_OPEN: "shm_open", SHM_ATTACH: "shm_attach", TOUCH: "touch",
}  # fmt: skip
ONE_WAY = frozenset({TOUCH})  # never answered (an error closes the connection instead)
FLAG_SHM = 1
FLAG_CLOSE = 2  # in a response: the server closes the connection after it (do not reuse it)


@dataclass(frozen=True)
class Head:
    op: int
    flags: int
    status: int
    meta_len: int
    body_len: int


def pack_head(op: int, meta: bytes, body_len: int = 0, flags: int = 0, status: int = 0) -> bytes:
    """The 16-byte header followed by the packed meta: everything of a message but its body."""
    return _HEAD.pack(op, flags, status, len(meta), body_len) + meta


def pack_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta)


def parse_head(data: bytes | bytearray | memoryview) -> Head:
    op, flags, status, meta_len, body_len = _HEAD.unpack_from(data)
    if meta_len > MAX_META:
        raise InvalidArgument(f"data-plane meta of {meta_len} bytes is over {MAX_META}")
    return Head(op, flags, status, meta_len, body_len)


def parse_meta(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(data) if len(data) else {}
    except Exception as e:  # msgpack raises many unrelated types on garbage
        raise InvalidArgument(f"data-plane meta is not msgpack: {type(e).__name__}") from None
    if not isinstance(meta, dict):
        raise InvalidArgument("data-plane meta must be a map")
    return meta


def meta_keys(meta: dict[str, Any]) -> list[str]:
    keys = meta.get("k")
    if not isinstance(keys, list) or not keys:
        raise InvalidArgument("a data-plane request names its keys in a non-empty list 'k'")
    if len(keys) > MAX_BATCH_KEYS:
        raise InvalidArgument(f"batch of {len(keys)} keys is over {MAX_BATCH_KEYS}")
    for key in keys:
        validate_key(key)
    return keys


def meta_lens(meta: dict[str, Any], n: int, allow_missing: bool = False) -> list[int]:
    lens = meta.get("l")
    lowest = MISSING if allow_missing else 0
    if not isinstance(lens, list) or len(lens) != n or not all(type(x) is int and x >= lowest for x in lens):
        raise InvalidArgument(f"'l' must list {n} {'lengths' if not allow_missing else 'lengths or -1'}")
    return lens


def meta_region(meta: dict[str, Any]) -> tuple[int, int, int]:
    """[segment id, offset, capacity] of a shared-memory request."""
    region = meta.get("s")
    if not isinstance(region, list) or len(region) != 3 or not all(type(x) is int and x >= 0 for x in region):
        raise InvalidArgument("'s' must be [segment id, offset, capacity]")
    return region[0], region[1], region[2]


def meta_pins(meta: dict[str, Any]) -> list[int]:
    """`u`: the pins a client gives back (at most MAX_PINS per request)."""
    pins = meta.get("u", [])
    if not isinstance(pins, list) or len(pins) > MAX_PINS or not all(type(x) is int for x in pins):
        raise InvalidArgument(f"'u' must list at most {MAX_PINS} pin ids")
    return pins


def error_meta(exc: KVStoreError) -> dict[str, Any]:
    return {"error": str(exc), "type": type(exc).__name__}


def error_from_meta(status: int, meta: dict[str, Any]) -> KVStoreError:
    """The typed exception a server sent in an error response."""
    cls = ERROR_TYPES.get(str(meta.get("type", "")), KVStoreError)
    exc = cls(str(meta.get("error", f"status {status}")))
    exc.status = status
    return exc


def total(lens: Sequence[int]) -> int:
    return sum(n for n in lens if n > 0)
