"""Why a read missed: the store's memory of what it wrote, for the miss reasons it reports.

A miss is one of:
- `not_stored`   this store never wrote the key (or deleted it, or wrote it too long ago to remember)
- `evicted`      written, not expired, not deleted, and gone: a tier's LRU (or Redis' maxmemory) made
                 room, or admission kept it in a tier that then evicted it
- `expired`      written, and its TTL has passed since the last write (a promotion is a write)
- `corrupt`      a copy failed verification (on this read or an earlier one) and was deleted
- `unreachable`  a tier that may hold it failed during the read (Redis down, I/O error)

The log remembers the last write time of the `capacity` most recently written keys (about 200
bytes each; 64Ki keys ~ 13 MiB), so a key written longer ago than that reads as `not_stored`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MISS_REASONS = ("not_stored", "evicted", "expired", "corrupt", "unreachable")
_CORRUPT = -1.0  # in place of a write time: the last copy we saw was corrupt


class MissLog:
    def __init__(self, capacity: int = 1 << 16) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._written: OrderedDict[str, float] = OrderedDict()  # key -> last write time
        self._lock = threading.Lock()

    def written(self, keys: list[str], now: float) -> None:
        if not self.capacity:
            return
        with self._lock:
            for key in keys:
                self._written.pop(key, None)
                self._written[key] = now
            while len(self._written) > self.capacity:
                self._written.popitem(last=False)

    def corrupt(self, key: str) -> None:
        with self._lock:
            if key in self._written or len(self._written) < self.capacity:
                self._written[key] = _CORRUPT

    def forget(self, key: str) -> None:
        with self._lock:
            self._written.pop(key, None)

    def reason(self, key: str, now: float, ttl: float | None) -> str:
        """Why `key`, which no tier holds (or could serve), is missing, from the log alone."""
        with self._lock:
            at = self._written.get(key)
        if at is None:
            return "not_stored"
        if at == _CORRUPT:
            return "corrupt"
        if ttl is not None and now >= at + ttl:
            return "expired"
        return "evicted"
