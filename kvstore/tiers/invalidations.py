"""Hinted handoff for a tier that can be out of reach: the keys it must delete before it may serve
them again (DESIGN.md, Spec 4: a delete or replace that could not reach a tier is replayed).

A delete, or a put replacing a blob the tier may hold, that cannot reach the backend adds the key
here. While a key is here the tier treats it as a miss (it never serves the older blob); a replayer
deletes it on the backend once that answers, then drops it from here. At most `limit` keys: `add`
returns those that do not fit, and the tier reports them as stale (the store fails the request).

Each entry has a generation: a put that started before a newer invalidation of the same key must not
clear it (`discard(key, gen)` only removes the generation it saw). `replay_lock` keeps a replayed
DEL and a put of the same key from crossing on the wire.
"""

from __future__ import annotations

import itertools
import threading


class Invalidations:
    """A bounded set of keys to delete on the backend, with generations. Thread-safe."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1, limit
        self.limit = limit
        self.replay_lock = threading.Lock()
        self._lock = threading.Lock()
        self._keys: dict[str, int] = {}
        self._gen = itertools.count(1)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, keys: list[str]) -> list[str]:
        """Remember `keys` (a key already here gets a new generation); returns those that did not fit."""
        overflow = []
        with self._lock:
            for key in keys:
                if key in self._keys or len(self._keys) < self.limit:
                    self._keys[key] = next(self._gen)
                else:
                    overflow.append(key)
        return overflow

    def generation(self, key: str) -> int | None:
        return self._keys.get(key)

    def discard(self, key: str, gen: int | None = None) -> None:
        """Forget `key`: it was deleted or overwritten on the backend (only if still at `gen`, if given)."""
        with self._lock:
            if key in self._keys and (gen is None or self._keys[key] == gen):
                del self._keys[key]

    def snapshot(self, n: int) -> list[tuple[str, int]]:
        """Up to `n` (key, generation) pairs, oldest first."""
        with self._lock:
            return list(itertools.islice(self._keys.items(), n))
