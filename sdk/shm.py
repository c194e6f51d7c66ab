"""The SDK's mapping of a server's shared-memory segment (kvstore.protocol.shm) and the regions it lends.

The client decides where data goes in its segment: a put copies its blobs into a free region and
names it; a get names a free region for the answer. Regions of a get stay taken while a `BlobLease`
of them is out, and go back to the allocator when it is released.

A get may instead be answered with blobs the server lends where they lie, in its arena (the cpu
tier's memory, mapped here read-only: `ClientArena`); the lease then ends by giving their pin back
in `unpin`, which the next request naming the segment carries to the server. Or, with the arena's
index mapped too, a get copies arena blobs out without a request at all (sdk.transfers.fetch_index).
"""

from __future__ import annotations

import collections
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from kvstore.blob import PreparedBlob
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.protocol import Blob, shm
from kvstore.protocol.arena_table import IndexReader, usable_here
from kvstore.protocol.dataplane import MAX_PINS

log = logging.getLogger(__name__)


class ClientArena:
    """A read-only mapping of the server's arena (kvstore.tiers.arena), and of its index when the
    server offers one (kvstore.protocol.arena_table)."""

    def __init__(self, size: int, nonce: bytes, mapped: mmap.mmap, index: IndexReader | None = None) -> None:
        self.size, self.nonce = size, nonce
        self._map = mapped
        self.view = memoryview(mapped)
        self.index = index

    def views(self, offsets: Sequence[int], lens: Sequence[int]) -> list[memoryview | None]:
        if len(offsets) != len(lens):
            raise InvalidArgument("the server lent other blobs than it announced")
        out: list[memoryview | None] = []
        for offset, n in zip(offsets, lens, strict=True):
            if n < 0:
                out.append(None)
                continue
            if type(offset) is not int or offset < shm.DATA_START or offset + n > self.size:
                raise InvalidArgument(f"the server lent a blob outside its arena ({offset}, +{n})")
            out.append(self.view[offset : offset + n])
        return out

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
        _unmap(self.view, self._map)


class ClientSegment:
    def __init__(
        self, seg_id: int, size: int, nonce: bytes, mapped: mmap.mmap, arena: ClientArena | None = None
    ) -> None:
        self.seg_id, self.size, self.nonce = seg_id, size, nonce
        self._map = mapped
        self.view = memoryview(mapped)
        self.allocator = shm.RegionAllocator(size)
        self.arena = arena
        self.unpin: collections.deque[int] = collections.deque()  # pins of ended leases, to give back

    def pins_to_give_back(self) -> list[int]:
        n = min(len(self.unpin), MAX_PINS)
        return [self.unpin.popleft() for _ in range(n)]

    def reserve(self, n: int) -> int | None:
        """The offset of a free region of `n` bytes, or None while the segment is too full."""
        return self.allocator.alloc(n)

    def largest(self) -> int:
        return self.allocator.largest()

    def free(self, offset: int, n: int) -> None:
        if n:
            self.allocator.free(offset, n)

    def write(self, offset: int, blobs: Sequence[Blob | PreparedBlob]) -> None:
        """The blobs back to back from `offset`: a PreparedBlob laid out in place (its payload copied
        once, from where the codec left it), a blob copied."""
        pos = offset
        for blob in blobs:
            if isinstance(blob, PreparedBlob):
                n = blob.nbytes
                blob.write_into(self.view[pos : pos + n])
            else:
                n = memoryview(blob).nbytes
                self.view[pos : pos + n] = memoryview(blob).cast("B")
            pos += n

    def views(self, offset: int, lens: Sequence[int]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        pos = offset
        for n in lens:
            if n < 0:
                out.append(None)
                continue
            out.append(self.view[pos : pos + n].toreadonly())
            pos += n
        return out

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        _unmap(self.view, self._map)


def _unmap(view: memoryview, mapped: mmap.mmap) -> None:
    view.release()
    try:
        mapped.close()
    except BufferError:  # a lease is still out: the mapping (and its fd) goes when its last view does
        logging.getLogger(__name__).debug("a shared-memory mapping outlives its close: a lease is still out")


def open_client_segment(client: Any, size: int, read_index: bool, url: str) -> ClientSegment | None:
    """A segment of `size` bytes from the server of `client` (kvstore.sdk.dataplane.DataPlaneClient),
    mapped here, with the server's arena (and its index, with `read_index`) when its HELLO offers them;
    None when the server offers none, runs on another host, or cannot be mapped from here."""
    hello = client.hello
    if not hello.get("shm") or hello.get("host") != shm.host_id() or not shm.host_id():
        return None  # the server offers none, or runs on another host
    try:
        opened = client.open_segment(size)
    except (KVStoreError, OSError, ConnectionError) as e:
        log.info("no shared memory from %s (%s): blobs go over TCP", url, e)
        return None
    if opened is None:
        log.info("%s has no shared memory to give (budget spent?): blobs go over TCP", url)
        return None
    meta, conn = opened
    mapped = shm.open_segment(meta["path"], meta["size"], meta["nonce"])
    if mapped is None:  # another PID namespace or user: closing the connection frees the segment
        client.drop(conn)
        log.info("cannot map the shared memory of %s: blobs go over TCP", url)
        return None
    client.keep(conn)
    arena = None
    described = hello.get("arena")
    if isinstance(described, list) and len(described) == 3:
        path, arena_size, nonce = described
        arena_map = shm.open_segment(path, arena_size, nonce, writable=False)
        if arena_map is not None:
            index = _map_index(hello, arena_size, url) if read_index else None
            arena = ClientArena(arena_size, nonce, arena_map, index)
    return ClientSegment(meta["seg"], meta["size"], meta["nonce"], mapped, arena)


def _map_index(hello: dict, arena_size: int, url: str) -> IndexReader | None:
    described = hello.get("index")
    if not usable_here() or not isinstance(described, list) or len(described) != 5:
        return None
    path, size, nonce, slots, seed = described
    mapped = shm.open_segment(path, size, nonce, writable=False)
    if mapped is None or type(slots) is not int or type(seed) is not int:
        return None
    try:
        return IndexReader(mapped, slots, seed, arena_size)
    except ValueError as e:
        mapped.close()
        log.info("not reading the arena index of %s: %s", url, e)
        return None
