"""Hinted handoff for a tier that can be out of reach: the keys it must delete before it may serve
them again (docs/design.md §10: a delete or replace that could not reach a tier is replayed).

A delete, or a put replacing a blob the tier may hold, that cannot reach the backend adds the key
here. While a key is here the tier treats it as a miss (it never serves the older blob); a replayer
deletes it on the backend once that answers, then drops it from here. At most `limit` keys: `add`
returns those that do not fit, and the tier reports them as stale (the store fails the request).

Each entry has a generation: a put that started before a newer invalidation of the same key must not
clear it (`discard(key, gen)` only removes the generation it saw). `replay_lock` keeps a replayed
DEL and a put of the same key from crossing on the wire.

With a `journal` (kvstore/tiers/handoff/journal.py) the set survives a restart: `add` returns only
once its keys are on disk (fsync'd), and a key it could not write there did not fit; the keys the
journal kept from before the restart are invalidated from the start.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable

from kvstore.tiers.handoff.journal import Journal

log = logging.getLogger("kvstore.tiers.handoff")


class Invalidations:
    """A bounded set of keys to delete on the backend, with generations. Thread-safe."""

    def __init__(self, limit: int, journal: Journal | None = None) -> None:
        assert limit >= 1, limit
        self.limit = limit
        self.replay_lock = threading.Lock()
        self._lock = threading.Lock()
        self._keys: dict[str, int] = {}
        self._gen = itertools.count(1)
        self._journal = journal
        if journal is not None:  # all of them, even beyond the limit: each must be deleted first
            self._keys = {key: next(self._gen) for key in journal.load()}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, keys: list[str]) -> list[str]:
        """Remember `keys` (a key already here gets a new generation); returns those that did not fit."""
        overflow, fit = [], []
        with self._lock:
            room = self.limit - len(self._keys)
            for key in dict.fromkeys(keys):
                if key in self._keys:
                    fit.append(key)
                elif room > 0:
                    fit.append(key)
                    room -= 1
                else:
                    overflow.append(key)
            if fit and self._journal is not None:
                try:
                    live = len(self._keys) + sum(1 for k in fit if k not in self._keys)
                    self._journal.append(added=fit, live=live)
                except OSError as e:  # not durable: not remembered (the caller fails the request)
                    log.error("cannot journal %d invalidations in %s: %s", len(fit), self._journal.dir, e)
                    return list(keys)
            for key in fit:
                self._keys[key] = next(self._gen)
        return overflow

    def generation(self, key: str) -> int | None:
        return self._keys.get(key)

    def discard(self, key: str, gen: int | None = None) -> None:
        """Forget `key`: it was deleted or overwritten on the backend (only if still at `gen`, if given)."""
        self.discard_many([(key, gen)])

    def discard_many(self, pairs: Iterable[tuple[str, int | None]]) -> None:
        """`discard` for each (key, gen), with one journal write."""
        with self._lock:
            gone = [k for k, gen in pairs if k in self._keys and (gen is None or self._keys[k] == gen)]
            for key in gone:
                del self._keys[key]
            if gone and self._journal is not None:
                try:
                    if self._journal.needs_rewrite():
                        self._journal.rewrite(self._keys)
                    else:
                        self._journal.append(removed=gone, live=len(self._keys))
                except OSError as e:  # they come back on a restart and are deleted again: a miss
                    log.error("cannot journal %d replayed invalidations in %s: %s", len(gone),
                              self._journal.dir, e)  # fmt: skip

    def close_journal(self) -> None:
        if self._journal is not None:
            with self._lock:
                self._journal.close(len(self._keys))

    def snapshot(self, n: int) -> list[tuple[str, int]]:
        """Up to `n` (key, generation) pairs, oldest first."""
        with self._lock:
            return list(itertools.islice(self._keys.items(), n))
