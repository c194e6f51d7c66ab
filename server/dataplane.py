"""The binary data plane on the HTTP port (kvstore.dataplane): one asyncio BufferedProtocol per connection.

Why it exists: aiohttp costs ~100-200 µs of Python per request and copies every body twice (the socket
read, then its parser) before a handler sees it; a profile of single-key calls shows that as the floor
(see benchmarks/bench_server.py). Here a request's payload is received straight into the buffer the
tier keeps (`recv_into` through `get_buffer`), a memory-only store is called inline without a task per
request, and a response is one `writelines` of the header and the tier's own buffers. Auth, limits,
metrics and errors are the HTTP routes' (`server.dataplane_ops`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from kvstore import dataplane as dp
from kvstore.errors import InvalidArgument, KVStoreError, TooLarge, Unauthorized
from server.dataplane_ops import Reply, Request, handle, inline_ops
from server.shm_pool import ShmPool
from server.state import ServerState

log = logging.getLogger(__name__)
_HEAD_BUF = 64 * 1024


class DataPlane:
    """What every data-plane connection of one server shares."""

    def __init__(self, state: ServerState, token: str | None) -> None:
        self.state = state
        self.token = token
        c = state.config
        self.shm = ShmPool(c.shm_budget, c.shm_max_segment)
        self.connections: set[DataPlaneProtocol] = set()

    def protocol(self) -> DataPlaneProtocol:
        return DataPlaneProtocol(self)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
        self.shm.close()


class DataPlaneProtocol(asyncio.BufferedProtocol):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.st = plane.state
        self.transport: Any = None
        self.authed = plane.token is None
        self.segments: dict[int, Any] = {}  # kvstore.shm.Segment this connection may name
        self._head = bytearray(_HEAD_BUF)
        self._have = 0  # valid bytes at the start of _head
        self._parts: list[memoryview] | None = None  # where the body of the pending request goes
        self._part_i = self._part_off = 0
        self._pending: tuple[dp.Head, dict, list[memoryview]] | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._busy = False  # a request is in the store's thread pool; reading is paused
        self._closed = False

    # -- connection --------------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.plane.connections.add(self)

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
        if self._body_timer is not None:
            self._body_timer.cancel()
        if not self._busy:
            self._release_segments()

    def _release_segments(self) -> None:
        for seg in self.segments.values():
            self.plane.shm.detach(seg)
        self.segments.clear()

    def close(self) -> None:
        if self.transport is not None and not self._closed:
            self.transport.close()

    def pause_writing(self) -> None:  # the client reads slower than we answer: stop taking requests
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self._busy:
            self.transport.resume_reading()

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
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        pending, self._pending = self._pending, None
        assert pending is not None
        self._dispatch(*pending)
        self._process()

    def _process(self) -> None:
        """Parse and serve every complete request in the head buffer (a client may pipeline small ones)."""
        while not self._busy and not self._closed and self._parts is None and self._have >= dp.HEAD_SIZE:
            view = memoryview(self._head)
            try:
                head = dp.parse_head(view)
                end = dp.HEAD_SIZE + head.meta_len
                if self._have < end:
                    return  # get_buffer grows the buffer while the meta does not fit
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
                timeout = self.st.config.body_timeout
                self._body_timer = asyncio.get_running_loop().call_later(timeout, self._body_stalled)
                return
            self._dispatch(head, meta, bufs)

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
        return [memoryview(np.empty(n, np.uint8)) for n in lens]  # not zeroed: recv_into fills it

    def _body_stalled(self) -> None:
        self._body_timer = None
        self._fail(
            InvalidArgument(f"truncated body: it did not arrive within {self.st.config.body_timeout:g} s")
        )

    # -- serving -----------------------------------------------------------------------------------------

    def _dispatch(self, head: dp.Head, meta: dict, bufs: list[memoryview]) -> None:
        if not self.authed and head.op != dp.HELLO:
            return self._fail(Unauthorized("the first data-plane message must be HELLO"))
        req = Request(head.op, head.flags, meta, [b.toreadonly() for b in bufs], time.perf_counter())
        self.st.metrics.in_flight += 1
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
            return Reply(e.status, dp.error_meta(e), close=req.op == dp.HELLO)
        except Exception as e:  # a bug in the server, not the client's fault: logged, answered with 500
            log.exception("unexpected error while serving a data-plane request", exc_info=e)
            return Reply(500, {"error": f"internal error: {type(e).__name__}", "type": "KVStoreError"})

    def _finish(self, req: Request, reply: Reply) -> None:
        st = self.st
        st.metrics.in_flight -= 1
        st.metrics.observe(reply.op_name or "unmatched", reply.status, time.perf_counter() - req.started,
                           reply.bytes_in, reply.bytes_out)  # fmt: skip
        was_busy, self._busy = self._busy, False
        if self._closed:
            if was_busy:
                self._release_segments()
            return
        body_len = sum(len(b) for b in reply.body)
        packed = dp.pack_meta(reply.meta)
        self.transport.writelines(
            [dp.pack_head(req.op, packed, body_len, reply.flags, reply.status), *reply.body]
        )
        if reply.close:
            self.transport.close()
            return
        if was_busy:
            self.transport.resume_reading()
            self._process()

    def _fail(self, exc: KVStoreError) -> None:
        """A request that cannot be answered in step (bad framing, a body too large to skip, a stall):
        answer once and close the connection."""
        if self._closed:
            return
        self.st.metrics.observe("unmatched", exc.status, 0.0, 0, 0)
        meta = dp.pack_meta(dp.error_meta(exc))
        self.transport.write(dp.pack_head(0, meta, 0, 0, exc.status))
        self.transport.close()
        self._closed = True
