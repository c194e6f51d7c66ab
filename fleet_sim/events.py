"""The discrete-event loop: callbacks run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.processed = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at time `when` (never before now: the past is not rewritten)."""
        if not math.isfinite(when):
            raise ValueError(f"an event at {when!r}")
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.processed += 1
            fn(*args)
