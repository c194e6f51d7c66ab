"""The binary data plane on the HTTP port (kvstore.protocol.dataplane): one asyncio BufferedProtocol per connection.

Why it exists: aiohttp costs ~100-200 µs of Python per request and copies every body twice (the socket
read, then its parser) before a handler sees it; a profile of single-key calls shows that as the floor
(see benchmarks/bench_server.py). Here a request's payload is received straight into the buffer the
tier keeps (`recv_into` through `get_buffer`), a memory-only store is called inline without a task per
request, and a response is one `writelines` of the header and the tier's own buffers. Auth, limits,
metrics and errors are the HTTP routes' (`kvstore.server.dataplane_ops`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from typing import Any

import numpy as np
from kvstore.server.dataplane_ops import Reply, Request, error_reply, handle, inline_ops
from kvstore.server.idle_poll import IdlePoll
from kvstore.server.shm_pool import ShmPool
from kvstore.server.state import ServerState

from kvstore.errors import InvalidArgument, KVStoreError, TooLarge, Unauthorized
from kvstore.protocol import dataplane as dp
from kvstore.protocol.arena_table import IndexReader

log = logging.getLogger(__name__)
_HEAD_BUF = 64 * 1024
_SMALL_ANSWER = 64 * 1024  # answers over this are charged to the body budget until they are read
MAX_HELLO_META = 4096  # a HELLO's meta: the version and the token


class DataPlane:
    """What every data-plane connection of one server shares."""

    def __init__(self, state: ServerState, token: str | None) -> None:
        self.state = state
        self.token = token
        c = state.config
        self.shm = ShmPool(c.shm_budget, c.shm_max_segment)
        tiers = state.store.tiers if self.shm.enabled and hasattr(state.store, "tiers") else []
        self.arena = next((t.arena for t in tiers if getattr(t, "arena", None) is not None), None)
        # clients may read the arena without asking only when it serves what a get would: the top tier
        top = tiers[0] if tiers else None
        on_top = top is not None and self.arena is not None and getattr(top, "arena", None) is self.arena
        self.arena_index = getattr(top, "arena_index", None) if on_top else None
        # the server's own read of that table, as a client reads it: what a TOUCH may report (dataplane_ops)
        self.index_reader = None if self.arena_index is None else IndexReader(
            self.arena_index.segment.map, self.arena_index.slots, self.arena_index.seed, self.arena.size
        )  # fmt: skip
        self.connections: set[DataPlaneProtocol] = set()
        self.unix_path: str | None = None  # the same-host Unix socket (server.runner), HELLO's `unix`
        self.idle_poll = IdlePoll(c.poll_us / 1e6)

    def protocol(self) -> DataPlaneProtocol:
        return DataPlaneProtocol(self)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
        self.index_reader = None  # its views of the table go, so that the tier can close it
        self.shm.close()
        self.idle_poll.close()


class DataPlaneProtocol(asyncio.BufferedProtocol):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.st = plane.state
        self.transport: Any = None
        self.authed = plane.token is None
        self.index_since: float | None = None  # when this connection's HELLO lent it the arena index
        self.segments: dict[int, Any] = {}  # kvstore.protocol.shm.Segment this connection may name
        self._polled = False  # a same-host client: its socket is in plane.idle_poll
        self._head = bytearray(_HEAD_BUF)
        self._have = 0  # valid bytes at the start of _head
        self._parts: list[memoryview] | None = None  # where the body of the pending request goes
        self._part_i = self._part_off = 0
        self._pending: tuple[dp.Head, dict, list[memoryview]] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the one deadline running now:
        self._deadline = ""  # "idle", "header" or "body"
        self._last_request = time.monotonic()  # when the last request arrived (the idle deadline's start)
        self._held: dict = {}  # this request's reservation in the body budget (server/budget.py)
        self._held_out: dict = {}  # and its answer's, while the client has not read it all
        self._busy = False  # a request is in the store's thread pool; reading is paused
        self._write_paused = False  # the transport holds more than its high-water mark of our answers
        self._closed = False

    # -- connection --------------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.plane.connections.add(self)
        sock = transport.get_extra_info("socket")
        self._polled = sock is not None and _same_host(sock) and self.plane.idle_poll.add(sock.fileno())
        self._arm_idle()

    def start(self, initial: bytes) -> None:
        """Called by the listener with the bytes it read to pick this protocol (the whole preface first)."""
        if initial[: len(dp.PREFACE)] != dp.PREFACE:
            return self._fail(InvalidArgument("bad data-plane preface"))
        rest = initial[len(dp.PREFACE) :]
        if len(rest) > len(self._head):
            self._head.extend(bytes(len(rest) - len(self._head)))
        self._head[: len(rest)] = rest
        self._have = len(rest)
        self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.plane.connections.discard(self)
        self._disarm()
        self.st.budget.release(self._held_out)
        if not self._busy:
            self.st.budget.release(self._held)
            self._release_segments()

    def _release_segments(self) -> None:
        for seg in self.segments.values():
            self.plane.shm.detach(seg)
        self.segments.clear()

    def close(self) -> None:
        if self.transport is not None and not self._closed:
            self.transport.close()

    # -- deadlines: an idle connection closes after keepalive_timeout, a message must arrive whole within
    # header_timeout (its header and meta) and body_timeout (its body), as on the HTTP side

    def _arm(self, seconds: float, fire: Any, deadline: str) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, fire)
        self._deadline = deadline

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._deadline = None, ""

    def _arm_idle(self) -> None:
        # One idle timer outlives the requests in between (a timer per request costs ~10 us): when it
        # fires, it closes the connection only if nothing happened for keepalive_timeout.
        if self._deadline != "idle":
            self._arm(self.st.config.keepalive_timeout, self._idle, "idle")

    def _idle(self) -> None:
        self._timer, self._deadline = None, ""
        left = self._last_request + self.st.config.keepalive_timeout - time.monotonic()
        # A client reading lent blobs may keep an idle connection: closing its last one would free them.
        if self._busy or left > 0 or any(seg.lent for seg in self.segments.values()):
            self._arm(max(left, 0.01), self._idle, "idle")
            return
        self.close()

    def _header_late(self) -> None:
        timeout = self.st.config.header_timeout
        self._fail(InvalidArgument(f"request header did not arrive within {timeout:g} s"), status=408)

    def _body_stalled(self) -> None:
        timeout = self.st.config.body_timeout
        self._fail(InvalidArgument(f"truncated body: it did not arrive within {timeout:g} s"))

    def _read_too_slowly(self) -> None:
        log.info(
            "a data-plane client did not read its answer within %g s: closed", self.st.config.body_timeout
        )
        self.transport.abort()

    def pause_writing(self) -> None:  # the client reads slower than we answer: stop taking requests
        self._write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._deadline == "drain":  # the answer is (nearly) all read: its blobs are free again
            self._disarm()
            self.st.budget.release(self._held_out)
        if not self._busy and not self._closed:
            self.transport.resume_reading()
            self._process()

    # -- receiving ---------------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._parts is not None:
            return self._parts[self._part_i][self._part_off :]
        if self._have == len(self._head):
            self._head.extend(bytes(len(self._head)))  # a large meta: grown up to MAX_META + header
        return memoryview(self._head)[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._parts is None:
            self._have += nbytes
            self._process()
            return
        self._part_off += nbytes
        self._advance_parts()

    def _advance_parts(self) -> None:
        assert self._parts is not None
        while self._part_i < len(self._parts) and self._part_off == len(self._parts[self._part_i]):
            self._part_i, self._part_off = self._part_i + 1, 0
        if self._part_i < len(self._parts):
            return
        self._parts = None
        self._disarm()
        pending, self._pending = self._pending, None
        assert pending is not None
        self._dispatch(*pending)
        self._process()

    def _process(self) -> None:
        """Parse and serve every complete request in the head buffer (a client may pipeline small ones)."""
        while not self._busy and not self._closed and self._parts is None and self._deadline != "drain":
            if self._have < dp.HEAD_SIZE:
                return self._wait_for_header()
            view = memoryview(self._head)
            try:
                head = dp.parse_head(view)
                if not self.authed:  # before HELLO: nothing but the header deadline (no budget, no buffer)
                    _check_unauthenticated(head)
                end = dp.HEAD_SIZE + head.meta_len
                if self._have < end:
                    view.release()
                    return self._wait_for_header()  # get_buffer grows the buffer for a large meta
                meta = dp.parse_meta(view[dp.HEAD_SIZE : end])
                bufs = self._body_buffers(head, meta)
            except KVStoreError as e:
                view.release()
                return self._fail(e)
            view.release()
            got = min(self._have - end, head.body_len)
            start = end
            for buf in bufs:  # body bytes that arrived with the header
                n = min(len(buf), end + got - start)
                buf[:n] = self._head[start : start + n]
                start += n
            rest = self._have - end - got
            self._head[:rest] = self._head[end + got : self._have]
            self._have = rest
            if got < head.body_len:
                self._parts, self._pending = bufs, (head, meta, bufs)
                self._part_i, self._part_off = 0, 0
                self._skip_filled(got)
                self._arm(self.st.config.body_timeout, self._body_stalled, "body")
                return
            self._dispatch(head, meta, bufs)

    def _wait_for_header(self) -> None:
        if not self._have:
            self._arm_idle()
        elif self._deadline != "header":  # part of a message is here: the rest has header_timeout
            self._arm(self.st.config.header_timeout, self._header_late, "header")

    def _skip_filled(self, got: int) -> None:
        assert self._parts is not None
        while got and got >= len(self._parts[self._part_i]):
            got -= len(self._parts[self._part_i])
            self._part_i += 1
        self._part_off = got

    def _body_buffers(self, head: dp.Head, meta: dict) -> list[memoryview]:
        """One buffer per blob of a put carried on the socket, each exactly its blob's size (so a stored
        blob never pins the memory of its whole request); checked against the limits before any byte."""
        if not head.body_len:
            return []
        if head.op != dp.PUT or head.flags & dp.FLAG_SHM:
            raise InvalidArgument(f"a {dp.OP_NAMES.get(head.op, head.op)} request carries no body")
        lens = dp.meta_lens(meta, len(dp.meta_keys(meta)))
        if sum(lens) != head.body_len:
            raise InvalidArgument(f"put body is {head.body_len} bytes but its blobs add up to {sum(lens)}")
        limit = self.st.store_config.max_blob_size if len(lens) == 1 else self.st.config.max_request_size
        if head.body_len > limit or max(lens) > self.st.store_config.max_blob_size:
            raise TooLarge(f"put of {head.body_len} bytes is over the limit ({limit})")
        self.st.budget.reserve(self._held, head.body_len)  # Busy (503) when too much is in flight
        return [self._body_buffer(n) for n in lens]

    def _body_buffer(self, n: int) -> memoryview:
        """Where a blob of a put is received: a region of the cpu arena when one is free (the tier then
        keeps it as it is), else a fresh buffer (not zeroed: recv_into fills it)."""
        arena = self.plane.arena
        region = None if arena is None else arena.reserve(n)
        return memoryview(np.empty(n, np.uint8) if region is None else region)

    # -- serving -----------------------------------------------------------------------------------------

    def _dispatch(self, head: dp.Head, meta: dict, bufs: list[memoryview]) -> None:
        req = Request(head.op, head.flags, meta, [b.toreadonly() for b in bufs], time.perf_counter())
        self.st.metrics.in_flight += 1
        self._last_request = time.monotonic()
        if self._deadline != "idle":
            self._disarm()
        if head.op == dp.PUT and head.flags & dp.FLAG_SHM:  # copied out of the segment: budgeted too
            try:
                self.st.budget.reserve(self._held, dp.total(dp.meta_lens(meta, len(dp.meta_keys(meta)))))
            except KVStoreError as e:
                self._finish(req, error_reply(e))
                return
        if self.st.inline or head.op in inline_ops:
            self._finish(req, self._serve(req))
            return
        self._busy = True
        self.transport.pause_reading()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.st.executor, self._serve, req)
        fut.add_done_callback(lambda f: self._finish(req, f.result()))

    def _serve(self, req: Request) -> Reply:
        try:
            return handle(self, req)
        except KVStoreError as e:
            reply = error_reply(e)
            reply.close = req.op == dp.HELLO
            return reply
        except Exception as e:  # a bug in the server, not the client's fault: logged, answered with 500
            log.exception("unexpected error while serving a data-plane request", exc_info=e)
            return Reply(500, {"error": f"internal error: {type(e).__name__}", "type": "KVStoreError"})

    def _finish(self, req: Request, reply: Reply) -> None:
        st = self.st
        st.metrics.in_flight -= 1
        st.budget.release(self._held)  # the body's bytes are a tier's now, or garbage
        st.metrics.observe(reply.op_name or "unmatched", reply.status, time.perf_counter() - req.started,
                           reply.bytes_in, reply.bytes_out)  # fmt: skip
        was_busy, self._busy = self._busy, False
        if self._closed:
            if was_busy:
                self._release_segments()
            return
        if req.op in dp.ONE_WAY:  # no answer: an error can only close the connection
            if reply.status >= 400:
                log.info("closing a data-plane connection: its %s failed (%s)", reply.op_name or req.op,
                         reply.meta.get("error"))  # fmt: skip
                self.transport.close()
            elif was_busy:
                self.transport.resume_reading()
                self._process()
            return
        body_len = sum(len(b) for b in reply.body)
        if body_len > _SMALL_ANSWER:  # it pins its blobs until the client has read them: budgeted
            try:
                st.budget.reserve(self._held_out, body_len)
            except KVStoreError as e:  # Busy: nothing is sent but the error
                reply, body_len = error_reply(e), 0
        packed = dp.pack_meta(reply.meta)
        flags = reply.flags | (dp.FLAG_CLOSE if reply.close else 0)
        self.transport.writelines([dp.pack_head(req.op, packed, body_len, flags, reply.status), *reply.body])
        if self._polled:
            self.plane.idle_poll.after_reply()
        if reply.close:
            self.transport.close()
            return
        if self._write_paused:  # over the transport's high-water mark: the rest goes as the client reads
            self._arm(st.config.body_timeout, self._read_too_slowly, "drain")
            return  # resume_writing goes on
        st.budget.release(self._held_out)
        if was_busy:  # an inline request returns to the loop in _process, which goes on by itself
            self.transport.resume_reading()
            self._process()

    def _fail(self, exc: KVStoreError, status: int | None = None) -> None:
        """A request that cannot be answered in step (bad framing, a body too large or too many to take,
        a stall): answer once and close the connection (its unread body cannot be skipped)."""
        if self._closed:
            return
        status = status or exc.status
        self.st.metrics.observe("unmatched", status, 0.0, 0, 0)
        meta = dp.pack_meta(error_reply(exc).meta)
        self.transport.write(dp.pack_head(0, meta, 0, dp.FLAG_CLOSE, status))
        self.transport.close()
        self._closed = True


def _check_unauthenticated(head: dp.Head) -> None:
    """What a connection may send before its HELLO is accepted: a HELLO of a small meta and no body.
    Anything else is refused from its 16-byte header, before any of it is received or reserved: a
    client without the token cannot hold body budget, buffer space or a store thread."""
    if head.op != dp.HELLO:
        raise Unauthorized("the first data-plane message must be HELLO")
    if head.body_len or head.meta_len > MAX_HELLO_META:
        raise InvalidArgument(f"a HELLO carries no body and at most {MAX_HELLO_META} bytes of meta")


def _same_host(sock: Any) -> bool:
    """A Unix-socket or loopback peer: a client on this host."""
    if sock.family == socket.AF_UNIX:
        return True
    try:
        return ipaddress.ip_address(sock.getpeername()[0]).is_loopback
    except (OSError, ValueError, IndexError):
        return False
