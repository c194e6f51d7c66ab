"""Plumbing shared by the tiers that keep their own LRU index in this process (cpu, disk, gpu)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from kvstore.lru import LRUIndex, check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.base import TOO_LARGE, TierStats, TierWriteError


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
        """Every item `put` in turn; the failures gathered into one TierWriteError at the end."""
        check_ttl(ttl_s)
        evicted: list[str] = []
        errors: list[TierWriteError] = []
        for key, blob in items:
            try:
                evicted.extend(self.put(key, blob, ttl_s))
            except TierWriteError as e:
                evicted.extend(e.evicted)
                errors.append(e)
        if errors:
            details = list(dict.fromkeys(e.detail for e in errors))  # the distinct ones, in order
            raise TierWriteError(
                errors[0].tier,
                {k: r for e in errors for k, r in e.failed.items()},
                "; ".join(details[:3]) + (f" (and {len(details) - 3} more)" if len(details) > 3 else ""),
                {k for e in errors for k in e.stale},
                evicted,
            )
        return evicted

    def _too_large(self, key: str, size: int) -> TierWriteError:
        """For a put over the whole capacity: the key is absent afterwards."""
        self.delete(key)
        return TierWriteError(
            getattr(self, "name", "tier"), {key: TOO_LARGE}, f"blob of {size} bytes is over its capacity"
        )
