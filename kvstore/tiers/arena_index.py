"""The server's side of the arena index (docs/design.md §8): it publishes where each blob of the cpu
arena lies for same-host clients, in the table whose layout, heartbeat and reader are
`kvstore.protocol.arena_table`, and withdraws a blob in the same locked step in which the tier lets
it go (`PublishedLRU`).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import TypeVar

import numpy as np

from kvstore.lru import Entry, LRUIndex
from kvstore.protocol import shm
from kvstore.protocol.arena_table import BEAT_AT, BEAT_S, ENTRY, MAX_KEY, Table, slots_for
from kvstore.tiers.arena import SEAL_FUTURE_WRITE, Arena

V = TypeVar("V")


class ArenaIndex(Table):
    """The server's side: the table in a sealed segment of its own. Not thread-safe: the cpu tier
    calls it under its lock."""

    def __init__(self, capacity: int) -> None:
        slots = slots_for(capacity)
        self.segment = shm.Segment(0, shm.DATA_START + slots * ENTRY, reserve=False, seals=SEAL_FUTURE_WRITE)
        super().__init__(self.segment.map, slots, secrets.randbits(63))
        self._beat = np.frombuffer(self.segment.map, np.int64, 1, BEAT_AT)
        self._beat[0] = time.monotonic_ns()
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beating, name="kvstore-arena-index", daemon=True)
        self._beater.start()

    def _beating(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat[0] = time.monotonic_ns()

    def stop_beating(self) -> None:
        """Readers stop using the table within STALE_S (at close; tests)."""
        self._stop.set()
        self._beater.join()

    def describe(self) -> list:
        """HELLO's `index`: [path, size, nonce, slots, seed]."""
        s = self.segment
        return [s.path, s.size, s.nonce, self.slots, self.seed]

    def publish(self, key: str, offset: int, length: int) -> None:
        kb = key.encode()
        assert len(kb) <= MAX_KEY and offset >= shm.DATA_START, (key, offset)
        s = self.where(kb)
        if s is None:
            home = self.slot(kb)
            s = home ^ 1 if self.words[home, 3] and not self.words[home ^ 1, 3] else home
        w = self.words[s]
        gen = int(w[0])
        w[0] = gen + 1  # readers of this slot start over from here
        w[1], w[2], w[3] = offset, length, len(kb)
        self.keys[s, : len(kb)] = np.frombuffer(kb, np.uint8)
        w[0] = gen + 2

    def withdraw(self, key: str) -> None:
        s = self.where(key.encode())
        if s is None:
            return
        w = self.words[s]
        gen = int(w[0])
        w[0] = gen + 1
        w[3] = 0
        w[0] = gen + 2

    def clear(self) -> None:
        """Withdraw everything (the tier was emptied)."""
        held = np.nonzero(self.words[:, 3])[0]
        self.words[held, 0] += 1
        self.words[held, 3] = 0
        self.words[held, 0] += 1

    def published(self) -> dict[str, tuple[int, int]]:
        """key -> (offset, length) of every published entry (for tests and checks)."""
        out = {}
        for s in np.nonzero(self.words[:, 3])[0]:
            n = int(self.words[s, 3])
            out[self.keys[s, :n].tobytes().decode()] = (int(self.words[s, 1]), int(self.words[s, 2]))
        return out

    def close(self) -> None:
        self.stop_beating()
        self._beat[0] = 0  # stale at once
        del self.words, self.keys, self._beat
        self.segment.close()  # closes its fd even while a view is alive (and logs that)


class PublishedLRU(LRUIndex[V]):
    """The cpu tier's LRUIndex when its blobs live in an arena: every entry that leaves it (evicted,
    popped, replaced) is withdrawn from `table`, and every arena blob without a TTL that enters it is
    published, within the same call (so under the tier's lock)."""

    def __init__(self, capacity: int, arena: Arena, table: ArenaIndex) -> None:
        super().__init__(capacity)
        self.arena, self.table = arena, table

    def pop(self, key: str) -> Entry[V] | None:
        entry = super().pop(key)
        if entry is not None:
            self.table.withdraw(key)
        return entry

    def pop_oldest(self) -> tuple[str, Entry[V]] | None:
        oldest = super().pop_oldest()
        if oldest is not None:
            self.table.withdraw(oldest[0])
        return oldest

    def insert(self, key: str, entry: Entry[V]) -> tuple[Entry[V] | None, list[tuple[str, Entry[V]]]]:
        replaced = super().insert(key, entry)  # withdraws the key's old entry through pop
        offset = self.arena.offset_of(entry.value) if entry.expires_at is None else None
        if offset is not None:
            self.table.publish(key, offset, entry.size)
        return replaced
