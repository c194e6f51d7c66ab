"""Where a kvstore-server's cpu tier keeps its blobs: one sealed memfd segment (kvstore.protocol.shm) that the
clients on the same host map read-only, so a get can lend them a blob where it lies instead of
copying it (docs/design.md §8: `GET` with `a`).

The segment is write-sealed (`F_SEAL_FUTURE_WRITE`): the server's own mapping stays writable, and
no other process can map it for writing, so a blob that was verified once stays what was verified.
Its pages are not reserved up front (the tier's capacity may be most of the host's memory); they are
touched as blobs arrive.

Each blob occupies one region for as long as any buffer of it is alive: the tier's entry, a reply
still being sent, a blob lent to a client (the connection holds it until the client gives it back or
goes away). An evicted blob that a client still reads keeps its region; the region returns to the
free list when its last buffer goes, so the tier's capacity is exact and the arena bounds the bytes.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np

from kvstore.protocol import Blob, shm

SEAL_FUTURE_WRITE = 0x0010  # F_SEAL_FUTURE_WRITE (Linux 5.1); the fcntl module does not name it


def arena_size(capacity: int) -> int:
    """Room for `capacity` blob bytes and the 64-byte rounding of each region, plus slack against
    fragmentation (a blob that finds no free region anyway is kept outside the arena: CpuTier)."""
    return capacity + capacity // 16 + (1 << 20) + shm.DATA_START


class Arena:
    def __init__(self, capacity: int) -> None:
        self.segment = shm.Segment(0, arena_size(capacity), reserve=False, seals=SEAL_FUTURE_WRITE)
        self.size = self.segment.size
        self._allocator = shm.RegionAllocator(self.size)
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._base = np.frombuffer(self.segment.map, np.uint8, 1).ctypes.data

    def _drain(self) -> None:
        # Regions are freed here, not in the finalizer: a finalizer can run inside the allocator's
        # locked section (the cyclic collector), where freeing would deadlock.
        while self._freed:
            self._allocator.free(*self._freed.popleft())

    def reserve(self, n: int) -> np.ndarray | None:
        """A free region of `n` bytes to fill (the server receives a put's body there, so the tier
        keeps it without a copy), or None when no free region is that large."""
        self._drain()
        offset = self._allocator.alloc(n)
        if offset is None:
            return None
        region = np.frombuffer(self.segment.map, np.uint8, n, offset)
        done = weakref.finalize(region, self._freed.append, (offset, n))
        done.atexit = False
        return region

    def store(self, blob: Blob) -> memoryview | None:
        """A read-only copy of `blob` in a free region, or None when no free region is that large."""
        src = memoryview(blob).cast("B")
        region = self.reserve(len(src))
        if region is None:
            return None
        region[:] = src
        return memoryview(region).toreadonly()

    def offset_of(self, blob: Blob) -> int | None:
        """Where `blob` starts in the segment, or None when it is not one of the arena's buffers."""
        if not isinstance(blob, memoryview):
            return None
        offset = np.frombuffer(blob, np.uint8).ctypes.data - self._base if blob.nbytes else -1
        return offset if shm.DATA_START <= offset < self.size else None

    def free_bytes(self) -> int:
        self._drain()
        return self._allocator.largest()

    def close(self) -> None:
        self.segment.close()  # a blob still referenced somewhere keeps the mapping (logged), not the fd
