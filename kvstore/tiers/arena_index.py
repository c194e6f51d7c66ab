"""Where each blob of the cpu arena lies, published for same-host clients (docs/design.md §8).

A same-host client reads an arena blob without asking the server: it finds the blob's region in this
table, copies it out, and checks that the table did not change meanwhile; a table miss, or a change,
and it asks the server as before. The server writes the table; clients map it read-only (sealed like
the arena, `F_SEAL_FUTURE_WRITE`), so no client can point a key at another key's bytes.

The table is 2-way set-associative: `slots` entries of 160 bytes in pairs; a key's home slot is
`xxh3_64(key, seed) % slots` (`seed` random per server, so no one can aim keys at another's slots)
and it may sit there or in the other slot of the pair (`home ^ 1`). A key whose pair is full takes
its home slot over (the key there is simply not published any more: its readers ask the server).
Each entry is a seqlock:

    word 0  generation: odd while the server rewrites the entry, even when it is whole
    word 1  offset of the blob in the arena      word 2  its length      word 3  the key's length
    bytes 32..160  the key (ASCII, at most 128 characters)

The server keeps one invariant: while an entry names a key, its region holds that key's blob,
unchanged. It publishes a blob once it is stored in the arena and withdraws it (in the same locked
step) when the tier lets it go: evicted, deleted, replaced or expired; a region is reused only after
that. So a reader that saw the same even generation before and after its copy, with its key in the
entry, copied the blob whole. Blobs with a TTL are not published (a reader could not see them expire).

A thread of the server writes the time (CLOCK_MONOTONIC, shared by every process on the host) into
the segment's first page every BEAT_S; a reader uses the table only while that time is under STALE_S
old, so a server that died or stopped costs its clients at most STALE_S of reads from the arena it
left behind (still the blobs it stored) before they ask the server, and find it gone.

The reader's checks rely on loads and stores not being reordered with each other (x86-64: TSO); on
other architectures (`usable_here`) the server does not offer the table in HELLO and the client does
not read one it is offered.
"""

from __future__ import annotations

import logging
import mmap
import platform
import secrets
import threading
import time
from typing import TypeVar

import numpy as np
import xxhash

from kvstore import shm
from kvstore.lru import Entry, LRUIndex
from kvstore.tiers.arena import SEAL_FUTURE_WRITE, Arena

V = TypeVar("V")
log = logging.getLogger(__name__)

ENTRY = 160
_WORDS = ENTRY // 8
_KEY_AT = 32
MAX_KEY = ENTRY - _KEY_AT
_BEAT_AT = 64  # in the first page, after kvstore.shm's header
BEAT_S = 0.05
STALE_S = 0.5


def usable_here() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def slots_for(capacity: int) -> int:
    """A power of two: about one slot per 16 KiB of capacity (4x the blobs of 64 KiB chunks), 1,024
    to 1,048,576 (a 160 MiB table at most, whose pages are only touched as slots fill)."""
    want = max(1024, min(1 << 20, capacity // (16 * 1024)))
    return 1 << (want - 1).bit_length()


class _Table:
    def __init__(self, buf: mmap.mmap, slots: int, seed: int) -> None:
        assert slots & (slots - 1) == 0, slots
        self.slots, self.seed = slots, seed
        self.words = np.frombuffer(buf, np.uint64, slots * _WORDS, shm.DATA_START).reshape(slots, _WORDS)
        self.keys = np.frombuffer(buf, np.uint8, slots * ENTRY, shm.DATA_START).reshape(slots, ENTRY)[
            :, _KEY_AT:
        ]

    def slot(self, key: bytes) -> int:
        """The key's home slot; it may also sit in `home ^ 1`."""
        return xxhash.xxh3_64_intdigest(key, self.seed) & (self.slots - 1)

    def _holds(self, s: int, key: bytes) -> bool:
        return int(self.words[s, 3]) == len(key) and self.keys[s, : len(key)].tobytes() == key

    def _where(self, key: bytes) -> int | None:
        home = self.slot(key)
        for s in (home, home ^ 1):
            if self._holds(s, key):
                return s
        return None


class ArenaIndex(_Table):
    """The server's side: the table in a sealed segment of its own. Not thread-safe: the cpu tier
    calls it under its lock."""

    def __init__(self, capacity: int) -> None:
        slots = slots_for(capacity)
        self.segment = shm.Segment(0, shm.DATA_START + slots * ENTRY, reserve=False, seals=SEAL_FUTURE_WRITE)
        super().__init__(self.segment.map, slots, secrets.randbits(63))
        self._beat = np.frombuffer(self.segment.map, np.int64, 1, _BEAT_AT)
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
        s = self._where(kb)
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
        s = self._where(key.encode())
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


class IndexReader(_Table):
    """A client's read-only mapping of a server's ArenaIndex, next to its mapping of the arena."""

    def __init__(self, mapped: mmap.mmap, slots: int, seed: int, arena_size: int) -> None:
        if mapped.size() < shm.DATA_START + slots * ENTRY or slots <= 0 or slots & (slots - 1):
            raise ValueError("the arena index is not the size its description says")
        super().__init__(mapped, slots, seed)
        self._map = mapped
        self.arena_size = arena_size
        self._beat = np.frombuffer(mapped, np.int64, 1, _BEAT_AT)

    def alive(self) -> bool:
        """Whether the server wrote its heartbeat within STALE_S."""
        return abs(time.monotonic_ns() - int(self._beat[0])) < STALE_S * 1e9

    def find(self, key: str) -> tuple[int, int, int, int] | None:
        """(slot, generation, offset, length) of `key`'s blob as the table says now, or None."""
        kb = key.encode()
        s = self._where(kb)
        if s is None:
            return None
        gen = int(self.words[s, 0])
        if gen & 1 or not self._holds(s, kb):  # being rewritten: seen whole, it may name another key
            return None
        offset, length = int(self.words[s, 1]), int(self.words[s, 2])
        if offset < shm.DATA_START or offset + length > self.arena_size:
            return None  # a torn read of an entry being rewritten: the generation check would say so too
        return s, gen, offset, length

    def unchanged(self, slot: int, gen: int) -> bool:
        """Whether the entry `find` read still has generation `gen`: a copy made since is whole."""
        return int(self.words[slot, 0]) == gen

    def close(self) -> None:
        del self.words, self.keys, self._beat
        try:
            self._map.close()
        except BufferError:  # the mapping (and the fd it holds) goes with its last view
            log.warning("the arena index's mapping closed while still viewed: unmapped with its last view")
