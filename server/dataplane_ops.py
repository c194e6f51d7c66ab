"""What each data-plane request does (kvstore.protocol.dataplane): a store operation is read off the meta
into its request (kvstore.protocol.ops), handled by the handler the HTTP route calls too
(kvstore.server.handlers) and its answer written back; the same limits, auth and metric names as the
HTTP routes, so the two transports cannot drift apart in what they allow. What is the data plane's own
is here: HELLO, shared memory (regions, lending the arena), TOUCH."""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.server import handlers
from kvstore.server.state import ServerState

from kvstore.errors import Busy, InvalidArgument, KVStoreError, TooLarge, Unauthorized
from kvstore.protocol import dataplane as dp
from kvstore.protocol import ops, shm
from kvstore.protocol.arena_table import usable_here
from kvstore.protocol.wire import MAX_BATCH_KEYS

log = logging.getLogger(__name__)
MAX_SEGMENTS_PER_CONNECTION = 4
inline_ops = frozenset({dp.HELLO, dp.SHM_OPEN, dp.SHM_ATTACH})  # never touch the store


class Connection(Protocol):
    """What a handler sees of its connection (kvstore.server.dataplane.DataPlaneProtocol)."""

    st: ServerState
    plane: Any  # kvstore.server.dataplane.DataPlane: token, shm pool
    segments: dict[int, shm.Segment]
    authed: bool
    index_since: float | None


@dataclass
class Request:
    op: int
    flags: int
    meta: dict[str, Any]
    bufs: list[memoryview]  # a socket put's blobs, read-only, each exactly one blob
    started: float


@dataclass
class Reply:
    status: int = 200
    meta: dict[str, Any] = field(default_factory=dict)
    body: list[Any] = field(default_factory=list)  # buffers sent after the header, as they are
    flags: int = 0
    close: bool = False
    op_name: str = ""  # the HTTP route's name, for the request metrics
    bytes_in: int = 0
    bytes_out: int = 0


def error_reply(exc: KVStoreError) -> Reply:
    meta = dp.error_meta(exc)
    if isinstance(exc, Busy):
        meta["retry_after"] = exc.retry_after
    return Reply(exc.status, meta)


def handle(conn: Connection, req: Request) -> Reply:
    if req.op == dp.HELLO:
        return _hello(conn, req)
    if req.op == dp.SHM_OPEN:
        return _shm_open(conn, req)
    if req.op == dp.SHM_ATTACH:
        return _shm_attach(conn, req)
    keys = dp.meta_keys(req.meta)
    if req.op == dp.GET:
        return _get(conn, req, keys)
    if req.op == dp.PUT:
        return _put(conn, req, keys)
    if req.op == dp.TOUCH:
        return _touch(conn, req, keys)
    row = _KEYS_OPS.get(req.op)
    if row is None:
        raise InvalidArgument(f"unknown data-plane op {req.op}")
    op, read, write = row
    answer = handlers.HANDLERS[op.name](conn.st, read(req.meta, {"keys": keys}))
    return Reply(ops.status(answer, len(keys)), write(answer), op_name=op.route_name(len(keys)))


_GET_WRITE = ops.writer(ops.GET.answer, ops.PLANE)
_PUT_READ, _PUT_WRITE = (
    ops.reader(ops.PutRequest, ops.PUT.request, ops.PLANE),
    ops.writer(ops.PUT.answer, ops.PLANE),
)
# the operations of keys alone: each one's row, how its meta is read and how its answer is written
_KEYS_OPS = {op.code: (op, ops.reader(op.types[0], op.request, ops.PLANE), ops.writer(op.answer, ops.PLANE))
             for op in (ops.EXISTS, ops.DELETE, ops.LOOKUP) if op.types is not None}  # fmt: skip


def _hello(conn: Connection, req: Request) -> Reply:
    if req.meta.get("v") != dp.VERSION:
        raise InvalidArgument(f"data-plane version {req.meta.get('v')!r} is not {dp.VERSION}")
    token = conn.plane.token
    if token is not None:
        given = req.meta.get("token")
        given_b = given.encode() if isinstance(given, str) else b""
        if not hmac.compare_digest(given_b, token.encode()):
            raise Unauthorized("missing bearer token" if not given_b else "wrong bearer token")
    conn.authed = True
    st = conn.st
    meta = {
        "v": dp.VERSION, "max_blob": st.store_config.max_blob_size, "max_request": st.config.max_request_size,
        "max_keys": MAX_BATCH_KEYS, "shm": conn.plane.shm.enabled, "host": shm.host_id(),
    }  # fmt: skip
    if conn.plane.unix_path is not None:
        meta["unix"] = conn.plane.unix_path
    arena = conn.plane.arena
    if arena is not None:
        meta["arena"] = [arena.segment.path, arena.size, arena.segment.nonce]
        if conn.plane.arena_index is not None and usable_here():  # its readers need x86-64's TSO
            meta["index"] = conn.plane.arena_index.describe()
            conn.index_since = time.monotonic()
    return Reply(meta=meta, op_name="hello")


def _region(conn: Connection, req: Request, need: int) -> tuple[shm.Segment, int, int]:
    seg_id, offset, capacity = dp.meta_region(req.meta)
    seg = conn.segments.get(seg_id)
    if seg is None:
        raise InvalidArgument(f"shared-memory segment {seg_id} is not attached to this connection")
    if offset < shm.DATA_START or offset + capacity > seg.size or need > capacity:
        raise InvalidArgument(f"region [{offset}, +{capacity}) of segment {seg_id} is out of bounds")
    for pin in dp.meta_pins(req.meta):
        seg.give_back(pin)
    return seg, offset, capacity


def _lend(conn: Connection, seg: shm.Segment, req: Request, blobs: list[Any], lens: list[int]) -> dict | None:
    """Lend the hits where they lie in the arena (kvstore.tiers.arena), when the client mapped it and
    all of them lie there; else None. Lent blobs keep their regions even once evicted, so one client
    may hold at most a quarter of the arena, and all together half: past that, gets copy."""
    arena = conn.plane.arena
    if arena is None or req.meta.get("a") != arena.segment.nonce:
        return None
    offsets = [arena.offset_of(b) for b in blobs if b is not None]
    nbytes = dp.total(lens)
    if None in offsets or seg.lent_bytes + nbytes > min(conn.st.config.shm_max_segment, arena.size // 4):
        return None
    if conn.plane.shm.lent_bytes() + nbytes > arena.size // 2:
        return None
    pin = seg.lend([b for b in blobs if b is not None], nbytes)
    where = iter(offsets)
    return {"a": [dp.MISSING if n < 0 else next(where) for n in lens], "p": pin}


def _get(conn: Connection, req: Request, keys: list[str]) -> Reply:
    answer = handlers.get(conn.st, ops.KeysRequest(keys))
    blobs, lens = answer.blobs, answer.lens
    total = dp.total(lens)
    reply = Reply(ops.status(answer, len(keys)), _GET_WRITE(answer),
                  bytes_out=total, op_name=ops.GET.route_name(len(keys)))  # fmt: skip
    present = [b for b in blobs if b is not None]
    if req.flags & dp.FLAG_SHM:
        seg, offset, capacity = _region(conn, req, 0)
        lent = _lend(conn, seg, req, blobs, lens)
        if lent is not None:
            reply.flags = dp.FLAG_SHM
            reply.meta.update(lent)
            return reply
        if total <= capacity:  # else the blobs come back on the socket, in this same reply
            pos = offset
            for b in present:
                n = memoryview(b).nbytes
                seg.view[pos : pos + n] = b
                pos += n
            reply.flags, reply.meta["o"] = dp.FLAG_SHM, offset
            return reply
    reply.body = present
    return reply


def _put(conn: Connection, req: Request, keys: list[str]) -> Reply:
    st = conn.st
    lens = dp.meta_lens(req.meta, len(keys))
    request = _PUT_READ(req.meta, {"keys": keys, "lens": lens})  # `x` checked before any put
    total = sum(lens)
    limit = st.store_config.max_blob_size if len(keys) == 1 else st.config.max_request_size
    if total > limit:
        raise TooLarge(f"put of {total} bytes is over the limit ({limit})")
    if req.flags & dp.FLAG_SHM:
        seg, offset, _ = _region(conn, req, total)
        pos = offset
        arena = conn.plane.arena
        for n in lens:  # copied out before the store verifies: the client cannot change what is checked
            with seg.view[pos : pos + n] as part:  # released here: the segment may close any time
                copied = None if arena is None else arena.store(part)  # where the cpu tier keeps it
                request.blobs.append(bytes(part) if copied is None else copied)
            pos += n
    else:
        request.blobs = req.bufs
    answer = handlers.put(st, request)
    meta = _PUT_WRITE(answer)
    return Reply(201, meta, op_name=ops.PUT.route_name(len(keys)), bytes_in=total)


def _touch(conn: Connection, req: Request, keys: list[str]) -> Reply:
    """Gets a client served itself through the arena index (`g`: [number of keys, seconds] of each, in
    the order of `k`). The server cannot see those reads, so what a report may claim is bounded, and
    it is counted apart from what the server measured:

    - only keys the index publishes now count, and only on a connection whose HELLO lent the index:
      those count as hits of the top tier (their recency refreshed); any other key is ignored (no
      read of a lower tier, no miss, no promotion);
    - a get's seconds are at most the time since that HELLO;
    - the gets and their seconds go to kvstore_reported_gets / kvstore_reported_get_seconds, never to
      the measured request metrics (kvstore_http_requests, kvstore_request_seconds)."""
    gets = req.meta.get("g")
    if (
        not isinstance(gets, list)
        or not all(
            isinstance(g, list)
            and len(g) == 2
            and type(g[0]) is int
            and g[0] > 0
            and isinstance(g[1], (int, float))
            and 0 <= g[1] < 3600
            for g in gets
        )  # fmt: skip
        or sum(g[0] for g in gets) != len(keys)
    ):
        raise InvalidArgument("TOUCH needs 'g', [number of keys, seconds] of each get of 'k'")
    reader = conn.plane.index_reader
    if reader is None or conn.index_since is None:
        return Reply(op_name="touch")
    longest = time.monotonic() - conn.index_since
    counted: list[str] = []
    pos = 0
    for n, seconds in gets:
        if all(reader.find(k) is not None for k in keys[pos : pos + n]):  # the index could serve it whole
            counted += keys[pos : pos + n]
            conn.st.metrics.observe_reported("get" if n == 1 else "batch_get", min(float(seconds), longest))
        pos += n
    if counted:
        conn.st.store.batch_get(counted)  # hits of the top tier, their recency refreshed
    return Reply(op_name="touch")


def _shm_open(conn: Connection, req: Request) -> Reply:
    size = req.meta.get("size")
    if type(size) is not int or size <= 0:
        raise InvalidArgument("SHM_OPEN needs a positive 'size'")
    if len(conn.segments) >= MAX_SEGMENTS_PER_CONNECTION:
        raise InvalidArgument(f"a connection may hold {MAX_SEGMENTS_PER_CONNECTION} segments at most")
    seg = conn.plane.shm.open(size) if conn.plane.shm.enabled else None
    if seg is None:  # off, or the budget is spent: a plain "no", the client stays on the socket
        return Reply(meta={"seg": None}, op_name="shm_open")
    conn.segments[seg.seg_id] = seg
    meta = {"seg": seg.seg_id, "path": seg.path, "size": seg.size, "nonce": seg.nonce}
    return Reply(meta=meta, op_name="shm_open")


def _shm_attach(conn: Connection, req: Request) -> Reply:
    seg_id, nonce = req.meta.get("seg"), req.meta.get("nonce")
    if type(seg_id) is not int or not isinstance(nonce, bytes):
        raise InvalidArgument("SHM_ATTACH needs 'seg' and 'nonce'")
    if seg_id not in conn.segments:
        if len(conn.segments) >= MAX_SEGMENTS_PER_CONNECTION:
            raise InvalidArgument(f"a connection may hold {MAX_SEGMENTS_PER_CONNECTION} segments at most")
        conn.segments[seg_id] = conn.plane.shm.attach(seg_id, nonce)
    return Reply(op_name="shm_attach")
