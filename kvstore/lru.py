"""An LRU index with exact byte accounting, and the TTL check, shared by the tiers.

Not thread-safe by itself: a tier holds its own lock around every call. The index only does the
book-keeping (order, sizes, expiry deadlines); what an entry's `value` means (a bytes object, a file
name, a device tensor) and what evicting it costs is the tier's business.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from typing import Generic, TypeVar

from kvstore.errors import InvalidArgument

V = TypeVar("V")


def check_ttl(ttl_s: float | None) -> float | None:
    """`ttl_s` when it is None (no expiry) or a positive, finite number of seconds; every tier calls
    this before it stores anything, so a bad TTL is an InvalidArgument whichever tier gets it."""
    if ttl_s is None:
        return None
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, (int, float))
        or not (math.isfinite(ttl_s) and ttl_s > 0)
    ):
        raise InvalidArgument(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
    return ttl_s


class Entry(Generic[V]):
    __slots__ = ("size", "expires_at", "value")

    def __init__(self, size: int, value: V, expires_at: float | None = None) -> None:
        self.size = size
        self.value = value
        self.expires_at = expires_at

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class LRUIndex(Generic[V]):
    """key -> Entry in least- to most-recently-used order; `used` is the exact sum of entry sizes."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[str, Entry[V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def peek(self, key: str) -> Entry[V] | None:
        """The entry without changing its recency."""
        return self._entries.get(key)

    def touch(self, key: str) -> None:
        self._entries.move_to_end(key)

    def pop(self, key: str) -> Entry[V] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.size
        return entry

    def pop_oldest(self) -> tuple[str, Entry[V]] | None:
        """Evict the least recently used entry (None when empty)."""
        if not self._entries:
            return None
        key, entry = self._entries.popitem(last=False)
        self.used -= entry.size
        return key, entry

    def make_room(self, size: int) -> list[tuple[str, Entry[V]]]:
        """Evict least-recently-used entries until `size` more bytes fit."""
        assert size <= self.capacity, (size, self.capacity)
        evicted: list[tuple[str, Entry[V]]] = []
        while self.used + size > self.capacity:
            oldest = self.pop_oldest()
            assert oldest is not None
            evicted.append(oldest)
        return evicted

    def make_room_for(self, key: str, size: int) -> list[tuple[str, Entry[V]]]:
        """Evict least-recently-used entries until `key` can hold `size` bytes (capped at the capacity)
        in place of what it holds now. Its current entry is made the last to go and stays readable
        until `insert` replaces it: a reader racing the overwrite sees the old value or the new one."""
        old = self._entries.get(key)
        if old is None:
            return self.make_room(min(size, self.capacity))
        self.touch(key)
        return self.make_room(max(0, min(size - old.size, self.capacity)))

    def insert(self, key: str, entry: Entry[V]) -> tuple[Entry[V] | None, list[tuple[str, Entry[V]]]]:
        """Add or replace `key` as most recently used, evicting LRU entries to fit.

        Returns (the replaced entry or None, the evicted (key, entry) pairs). The caller has checked
        `entry.size <= capacity`.
        """
        old = self.pop(key)
        evicted = self.make_room(entry.size)
        self._entries[key] = entry
        self.used += entry.size
        assert self.used <= self.capacity, (self.used, self.capacity)
        return old, evicted

    def items(self) -> Iterator[tuple[str, Entry[V]]]:
        """A snapshot, least recently used first."""
        return iter(list(self._entries.items()))

    def pop_expired(self, now: float, limit: int = 64) -> list[tuple[str, Entry[V]]]:
        """Drop up to `limit` expired entries from the LRU end (a cheap, incremental sweep)."""
        oldest = list(islice(self._entries.items(), limit))
        out = [(key, entry) for key, entry in oldest if entry.expired(now)]
        for key, _ in out:
            self.pop(key)
        return out
