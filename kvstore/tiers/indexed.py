"""Plumbing shared by the tiers that keep their own LRU index in this process (cpu, disk, gpu)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from kvstore.lru import LRUIndex, check_ttl
from kvstore.tiers.base import Blob, TierStats


class IndexedTier:
    """Subclasses set `_index` (an LRUIndex holding exactly the stored blobs' sizes), `_lock`,
    `_clock` (the clock their expiry times are on) and `stats`, and implement get/put. `contains` and
    `delete` here suit tiers whose index holds the data itself; the disk tier overrides them."""

    _index: LRUIndex
    _lock: threading.Lock | threading.RLock
    _clock: Callable[[], float]
    stats: TierStats

    def get(self, key: str) -> Blob | None:
        raise NotImplementedError

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._index.peek(key)
            if entry is not None and entry.expired(now):
                self._index.pop(key)
                self.stats.expired += 1
                return False
            return entry is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._index.pop(key) is not None

    def keys(self) -> Iterator[str]:
        now = self._clock()
        with self._lock:
            return iter([k for k, e in self._index.items() if not e.expired(now)])

    def usage(self) -> int:
        return self._index.used

    def __len__(self) -> int:
        return len(self._index)

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        check_ttl(ttl_s)
        evicted: list[str] = []
        for key, blob in items:
            evicted.extend(self.put(key, blob, ttl_s))
        return evicted
