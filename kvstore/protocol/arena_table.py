"""The arena index's table as both ends see it (docs/design.md §8): its layout, its heartbeat, and the
client's reader. The server's writer is `kvstore.tiers.arena_index.ArenaIndex`.

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
import time

import numpy as np
import xxhash

from kvstore.protocol import shm

log = logging.getLogger(__name__)

ENTRY = 160
WORDS = ENTRY // 8
KEY_AT = 32
MAX_KEY = ENTRY - KEY_AT
BEAT_AT = 64  # in the first page, after kvstore.protocol.shm's header
BEAT_S = 0.05
STALE_S = 0.5


def usable_here() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def slots_for(capacity: int) -> int:
    """A power of two: about one slot per 16 KiB of capacity (4x the blobs of 64 KiB chunks), 1,024
    to 1,048,576 (a 160 MiB table at most, whose pages are only touched as slots fill)."""
    want = max(1024, min(1 << 20, capacity // (16 * 1024)))
    return 1 << (want - 1).bit_length()


class Table:
    """The entries of a table mapped at `buf` (the writer's and the reader's common part)."""

    def __init__(self, buf: mmap.mmap, slots: int, seed: int) -> None:
        assert slots & (slots - 1) == 0, slots
        self.slots, self.seed = slots, seed
        self.words = np.frombuffer(buf, np.uint64, slots * WORDS, shm.DATA_START).reshape(slots, WORDS)
        self.keys = np.frombuffer(buf, np.uint8, slots * ENTRY, shm.DATA_START).reshape(slots, ENTRY)[
            :, KEY_AT:
        ]

    def slot(self, key: bytes) -> int:
        """The key's home slot; it may also sit in `home ^ 1`."""
        return xxhash.xxh3_64_intdigest(key, self.seed) & (self.slots - 1)

    def holds(self, s: int, key: bytes) -> bool:
        return int(self.words[s, 3]) == len(key) and self.keys[s, : len(key)].tobytes() == key

    def where(self, key: bytes) -> int | None:
        home = self.slot(key)
        for s in (home, home ^ 1):
            if self.holds(s, key):
                return s
        return None


class IndexReader(Table):
    """A client's read-only mapping of a server's ArenaIndex, next to its mapping of the arena."""

    def __init__(self, mapped: mmap.mmap, slots: int, seed: int, arena_size: int) -> None:
        if mapped.size() < shm.DATA_START + slots * ENTRY or slots <= 0 or slots & (slots - 1):
            raise ValueError("the arena index is not the size its description says")
        super().__init__(mapped, slots, seed)
        self._map = mapped
        self.arena_size = arena_size
        self._beat = np.frombuffer(mapped, np.int64, 1, BEAT_AT)

    def alive(self) -> bool:
        """Whether the server wrote its heartbeat within STALE_S."""
        return abs(time.monotonic_ns() - int(self._beat[0])) < STALE_S * 1e9

    def find(self, key: str) -> tuple[int, int, int, int] | None:
        """(slot, generation, offset, length) of `key`'s blob as the table says now, or None."""
        kb = key.encode()
        s = self.where(kb)
        if s is None:
            return None
        gen = int(self.words[s, 0])
        if gen & 1 or not self.holds(s, kb):  # being rewritten: seen whole, it may name another key
            return None
        offset, length = int(self.words[s, 1]), int(self.words[s, 2])
        if offset < shm.DATA_START or offset + length > self.arena_size:
            return None  # a torn read of an entry being rewritten: the generation check would say so too
        return s, gen, offset, length

    def find_all(self, keys: list[str]) -> list[tuple[int, int, int, int]] | None:
        """`find` of every key, or None when one is not in the table or the server's heartbeat is
        stale (it died or stopped: the caller asks it, and finds out)."""
        if not self.alive():
            return None
        found = []
        for key in keys:
            where = self.find(key)
            if where is None:
                return None
            found.append(where)
        return found

    def unchanged(self, slot: int, gen: int) -> bool:
        """Whether the entry `find` read still has generation `gen`: a copy made since is whole."""
        return int(self.words[slot, 0]) == gen

    def close(self) -> None:
        del self.words, self.keys, self._beat
        try:
            self._map.close()
        except BufferError:  # the mapping (and the fd it holds) goes with its last view
            log.warning("the arena index's mapping closed while still viewed: unmapped with its last view")
