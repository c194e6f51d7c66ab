"""Hinted handoff for any tier that declares it (kvstore.tier_registry, `handoff`): invalidated keys
(invalidations.py) and the thread that deletes them on the backend once it answers.

The replayer wakes every REPLAY_INTERVAL_S while keys wait (at once when one is added), hands the
tier's `delete` up to REPLAY_BATCH of them (the redis tier: one pipelined DEL per server; the fs tier:
a tombstone each), and forgets those it confirmed. A backend that is down should cost nothing there
(the redis tier's circuit breaker fails the call without touching the network until its next probe).
With a journal the keys survive a restart (journal.py): those kept from before it are replayed like
any other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable

from kvstore.tiers.base import TierStats
from kvstore.tiers.handoff.invalidations import Invalidations
from kvstore.tiers.handoff.journal import Journal

log = logging.getLogger("kvstore.tiers.handoff")
REPLAY_INTERVAL_S = 0.2
REPLAY_BATCH = 1000


class Handoff(Invalidations):
    """Invalidations plus their replayer. `delete(keys)` deletes on the backend and returns the keys
    it confirmed deleted; `stats.extra["invalidated"]` follows the number of keys waiting."""

    def __init__(
        self,
        limit: int,
        delete: Callable[[list[str]], Collection[str]],
        name: str,
        stats: TierStats,
        journal: Journal | None = None,
    ) -> None:
        super().__init__(limit, journal)
        self._delete = delete
        self._name = name
        self._stats = stats
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stats.extra["invalidated"] = len(self)
        if len(self):
            self._ensure_thread()

    def add(self, keys: list[str]) -> list[str]:
        """Invalidate `keys` until the backend deletes them; returns those that did not fit."""
        overflow = super().add(keys)
        self._stats.extra["invalidated"] = len(self)
        if len(overflow) < len(keys):
            self._ensure_thread()
            self._wake.set()
        if overflow:
            log.error(
                "%s: %d invalidated keys wait for the backend (the limit); %d more could not be remembered",
                self._name, len(self), len(overflow),
            )  # fmt: skip
        return overflow

    def discard_many(self, pairs: Iterable[tuple[str, int | None]]) -> None:
        super().discard_many(pairs)
        self._stats.extra["invalidated"] = len(self)

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-handoff", daemon=True)
                self._thread.start()

    def replay(self) -> int:
        """One round: delete a batch of invalidated keys on the backend. Returns how many were cleared."""
        batch = self.snapshot(REPLAY_BATCH)
        if not batch:
            return 0
        with self.replay_lock:
            done = self._delete([k for k, _ in batch])
        self.discard_many((key, gen) for key, gen in batch if key in done)
        if done:
            log.info("%s: replayed %d invalidations, %d still waiting", self._name, len(done), len(self))
        return len(done)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(REPLAY_INTERVAL_S)
            self._wake.clear()
            if self._closed:
                return
            try:
                while self.replay() == REPLAY_BATCH and not self._closed:
                    pass  # a full batch went through: there may be more right away
            except Exception:  # the replayer must outlive any one bad round
                log.exception("%s: replaying invalidations failed", self._name)

    def close(self, timeout: float) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.close_journal()
