"""The server's shared-memory segments (kvstore.protocol.shm): created on request within a byte budget, closed
when the last connection attached to one goes away. The budget is part of the server's memory bound:
RSS <= idle + tier capacities + request bodies in flight + `shm_budget`."""

from __future__ import annotations

import logging

from kvstore.errors import InvalidArgument
from kvstore.protocol import shm

log = logging.getLogger(__name__)
MIN_SEGMENT = 1 << 20


class ShmPool:
    def __init__(self, budget: int, max_segment: int) -> None:
        self.budget = budget if shm.available() else 0
        self.max_segment = max_segment
        self.used = 0
        self._segments: dict[int, shm.Segment] = {}
        self._refs: dict[int, int] = {}
        self._next_id = 1

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._segments)

    def open(self, size: int) -> shm.Segment | None:
        """A new segment of about `size` bytes attached once, or None when the budget is spent."""
        size = min(max(size, MIN_SEGMENT), self.max_segment, self.budget - self.used)
        size -= size % shm.ALIGN
        if size < MIN_SEGMENT:
            return None
        try:
            seg = shm.Segment(self._next_id, size)
        except OSError as e:  # tmpfs full, memfd unsupported...: this client stays on TCP
            log.warning("cannot create a %d-byte shared-memory segment: %s", size, e)
            return None
        self._next_id += 1
        self._segments[seg.seg_id] = seg
        self._refs[seg.seg_id] = 1
        self.used += seg.size
        return seg

    def lent_bytes(self) -> int:
        """Bytes of the arena lent to all clients together (kvstore.protocol.shm.Segment.lend)."""
        return sum(seg.lent_bytes for seg in self._segments.values())

    def attach(self, seg_id: int, nonce: bytes) -> shm.Segment:
        seg = self._segments.get(seg_id)
        if seg is None or nonce != seg.nonce:
            raise InvalidArgument(f"no shared-memory segment {seg_id} with that nonce")
        self._refs[seg_id] += 1
        return seg

    def detach(self, seg: shm.Segment) -> None:
        if seg.seg_id not in self._refs:  # closed with the pool already (server shutdown)
            return
        self._refs[seg.seg_id] -= 1
        if self._refs[seg.seg_id] == 0:
            seg.close()
            del self._refs[seg.seg_id], self._segments[seg.seg_id]
            self.used -= seg.size

    def close(self) -> None:
        for seg in list(self._segments.values()):
            seg.close()
        self._segments.clear()
        self._refs.clear()
        self.used = 0
