"""The data-plane wire of `kvstore.sdk.remote.RemoteBackend`: every store operation of kvstore.protocol.ops
over `kvstore.sdk.dataplane.DataPlaneClient` (docs/design.md §7), with the same methods as
`kvstore.sdk.http_transport.HttpTransport`; blobs in shared memory when the server is on this host (§8).

A get of blobs a same-host server's arena index places is read without a request (`sdk.transfers`
fetch_index / lend_index, reported later with TOUCH); else through the client's shared-memory segment
(lent where they lie in the arena, or written into the segment); else on the socket. A put of 16 KiB or
more goes through the segment, smaller ones and the rest on the socket. The metas are written and read
through the table (`ops.to_wire` / `ops.answer_from`)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.sdk import transfers as tr
from kvstore.sdk.backend import Outgoing
from kvstore.sdk.buffers import Loan
from kvstore.sdk.dataplane import DataPlaneClient, SegmentGone
from kvstore.sdk.shm import ClientArena, ClientSegment, open_client_segment
from kvstore.sdk.touches import TouchReporter

from kvstore.errors import TooLarge, Unavailable
from kvstore.protocol import Blob, ops, wire

log = logging.getLogger(__name__)
T = TypeVar("T")
SHM_MIN_BLOB = 16 * 1024  # smaller blobs gain nothing from shared memory: they ride in the request
# A lease of more bytes than this is lent by the server where the blobs lie rather than copied out of
# its arena without a request: past ~3 MiB the round trip (~0.2-0.3 ms) costs less than the copy
# (~0.07 ms/MiB more than verifying in place; bench_server.py: 4 MiB and 8 x 1 MiB lent and verified
# ran at 1.1-1.3x the copy, 8 x 256 KiB at 0.65x)
INDEX_LEASE_MAX = 3 * 2**20


# how the operations of keys alone write their request and read their answer on the data plane
_CODES = {op.code: (ops.writer(op.request, ops.PLANE), ops.reader(op.types[1], op.answer, ops.PLANE))
          for op in (ops.EXISTS, ops.DELETE, ops.LOOKUP) if op.types is not None}  # fmt: skip
_PUT_WRITE, _PUT_READ = (
    ops.writer(ops.PUT.request, ops.PLANE),
    ops.reader(ops.PutAnswer, ops.PUT.answer, ops.PLANE),
)


def _tell_through(transport: weakref.ref) -> Callable[[int, dict], None]:
    def tell(op: int, meta: dict) -> None:
        t = transport()
        if t is not None:
            t.client.tell(op, meta)

    return tell


class PlaneTransport:
    """One server's data plane, and its shared memory once asked for (`segment`)."""

    def __init__(
        self, client: DataPlaneClient, url: str, wanted: str, shm_size: int, read_index: bool, counts: Counter
    ) -> None:
        """`wanted`: "auto" (shared memory when it can be had), "shm" (Unavailable when not) or "tcp"
        (never); `read_index`: read the arena's blobs through its index; `counts` (shared with the
        backend): calls by the path their blobs took."""
        self.client, self.url, self.wanted = client, url, wanted
        self.shm_size, self.read_index, self.counts = shm_size, read_index, counts
        self.segment: ClientSegment | None = None
        self._shm_state = "done" if wanted == "tcp" else "untried"  # done: `segment` is final
        self._lock = threading.Lock()
        self._blob_hint = 8 * 2**20  # room a get asks for per key in shared memory; grows with what it sees
        self._touches = TouchReporter(_tell_through(weakref.ref(self)))
        # dropped without close(), the transport still goes at once (no cycle through the reporter),
        # and takes the reporter's thread with it
        weakref.finalize(self, self._touches.close)

    @property
    def name(self) -> str:
        return "shm" if self.shm() is not None else "tcp"

    def shm(self) -> ClientSegment | None:
        """The shared-memory segment (set up on first use), or None."""
        if self._shm_state == "untried":
            with self._lock:
                if self._shm_state == "untried":
                    self.segment = open_client_segment(self.client, self.shm_size, self.read_index, self.url)
                    self._shm_state = "done"
        if self.segment is None and self.wanted == "shm":
            raise Unavailable(f"shared memory with {self.url} is not available")
        return self.segment

    def _forget(self, seg: ClientSegment) -> None:
        """The server restarted and lost `seg`: the next call maps a new one (leases of it stay valid)."""
        with self._lock:
            if self.segment is seg:
                self.segment, self._shm_state = None, "untried"
        log.info("the shared-memory segment of %s is gone (server restart?): mapping a new one", self.url)

    # -- gets --------------------------------------------------------------------------------------------

    def get(
        self, keys: list[str], rx: tr.Receiver, reasons: list[str | None] | None
    ) -> tuple[list[Blob | None], Loan | None, list | None]:
        """The blobs of `keys` where `rx` puts them, their Loan, and their headers where this process
        verified them (else None); `reasons` (if given) receives why each miss missed."""
        seg = self.shm()
        read = self._via_index(
            seg, keys, lambda arena: tr.fetch_index(arena, keys, rx, INDEX_LEASE_MAX), "index"
        )
        if read is not None:
            if reasons is not None:
                reasons[:] = [None] * len(keys)
            (blobs, loan), headers = read
            return blobs, loan, headers
        got = None
        if seg is not None:
            try:
                got = tr.fetch_shm(self.client, seg, keys, rx, len(keys) * self._blob_hint)
            except SegmentGone:
                self._forget(seg)
        if got is not None:
            meta, (blobs, loan), in_shm = got
            if not in_shm:  # too large for the room asked: ask for more next time
                self._blob_hint = max([self._blob_hint, *(len(b) for b in blobs if b is not None)])
        else:
            in_shm = False
            meta, (blobs, loan) = tr.fetch_socket(self.client, keys, rx)
        self.counts["shm" if in_shm else "tcp"] += 1
        if reasons is not None:
            reasons[:] = tr.reasons_of(meta, blobs)
        return blobs, loan, None

    def lend_in_place(self, keys: list[str]) -> Any:
        """`sdk.transfers.lend_index` of `keys`: where they lie in the arena, without a request; None
        when the index cannot tell (the caller asks the server)."""
        return self._via_index(self.shm(), keys, lambda arena: tr.lend_index(arena, keys), "in_place")

    def _via_index(
        self, seg: ClientSegment | None, keys: list[str], read: Callable[[ClientArena], T | None], path: str
    ) -> T | None:
        """`read(arena)`: blobs of a same-host server's arena found by its index, without a request
        (None: ask the server). What it read is reported to the server and counted as `path`."""
        if seg is None or seg.arena is None or seg.arena.index is None or len(keys) > wire.MAX_BATCH_KEYS:
            return None
        started = time.perf_counter()
        got = read(seg.arena)
        if got is not None:  # the server counts the reads as gets and refreshes their recency
            self._touches.add(keys, time.perf_counter() - started)
            self.counts[path] += 1
        return got

    # -- puts and the rest -------------------------------------------------------------------------------

    def put(self, req: ops.PutRequest, blobs: Sequence[Outgoing]) -> ops.PutAnswer:
        """Store the blobs (`req.replaces` deleted by the server once every one is stored: `replaced`,
        None from a server that predates it)."""
        hello, lens = self.client.hello, req.lens
        limit = hello["max_blob"] if len(lens) == 1 else hello["max_request"]
        if sum(lens) > limit or max(lens) > hello["max_blob"]:
            raise TooLarge(f"put of {sum(lens)} bytes is over the server's limit ({limit})")
        meta = _PUT_WRITE(req)
        seg = self.shm() if sum(lens) >= SHM_MIN_BLOB else None
        answer = None
        if seg is not None:
            try:
                answer = tr.put_shm(self.client, seg, meta, blobs)
            except SegmentGone:
                self._forget(seg)
            if answer is not None:
                self.counts["shm"] += 1
        if answer is None:
            self.counts["tcp"] += 1
            answer = tr.put_socket(self.client, meta, blobs)
        return _PUT_READ(answer, {})

    def call(self, op: ops.Op, req: Any) -> Any:
        """An operation of keys (exists, delete, lookup): one request, its meta through the table."""
        write, read = _CODES[op.code]
        return read(self.client.call(op.code, write(req))[1], {})

    def close(self) -> None:
        self._touches.close()  # what it still holds goes out first
        with self._lock:
            seg, self.segment, self._shm_state = self.segment, None, "done"
        self.client.close()
        if seg is not None:
            seg.close()
