"""The SDK's mapping of a server's shared-memory segment (kvstore.shm) and the regions it lends.

The client decides where data goes in its segment: a put copies its blobs into a free region and
names it; a get names a free region for the answer. Regions of a get stay taken while a `BlobLease`
of them is out, and go back to the allocator when it is released.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from kvstore import shm
from kvstore.tiers.base import Blob


class ClientSegment:
    def __init__(self, seg_id: int, size: int, nonce: bytes, mapped: mmap.mmap) -> None:
        self.seg_id, self.size, self.nonce = seg_id, size, nonce
        self._map = mapped
        self.view = memoryview(mapped)
        self.allocator = shm.RegionAllocator(size)

    def reserve(self, n: int) -> int | None:
        """The offset of a free region of `n` bytes, or None while the segment is too full."""
        return self.allocator.alloc(n)

    def largest(self) -> int:
        return self.allocator.largest()

    def free(self, offset: int, n: int) -> None:
        if n:
            self.allocator.free(offset, n)

    def write(self, offset: int, blobs: Sequence[Blob]) -> None:
        pos = offset
        for blob in blobs:
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
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a lease is still out: the mapping goes when its last view does
            pass
