"""What one process knows of its blobs in Redis: key -> (blob size, expiry), behind the redis tier's
`usage()` and `len()`.

Redis evicts and expires on its own and other processes write too, so this is a view, kept honest
three ways: each put/get/delete of the tier updates it; a known key found missing is forgotten and
counted (`stats.expired` when its TTL had passed, else `stats.evictions`); and `rebuild` replaces it
with what a SCAN of the servers found (`scan_sizes`: SCAN our prefix, then STRLEN + PTTL pipelined),
keeping whatever changed while the scan ran and whatever lives on servers that could not be scanned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from kvstore.clock import SYSTEM, Clock
from kvstore.tiers.base import TierStats

SCAN_BATCH = 1000
Sizes = dict[str, tuple[int, float | None]]  # key -> (blob bytes, expiry on the clock's monotonic, or None)


class KeyIndex:
    """key -> (size, expiry) with the byte total. Thread-safe."""

    def __init__(self, stats: TierStats, clock: Clock = SYSTEM) -> None:
        """`clock`: the store's; the expiries it expects (Redis expires keys by its own clock)."""
        self.stats, self.clock = stats, clock
        self._lock = threading.Lock()
        self._entries: Sizes = {}
        self._bytes = 0
        self._n_ttl = 0
        self._touched: set[str] | None = None  # keys changed while a rebuild runs
        self.complete = False  # a rebuild has scanned every server: a key not here is not there

    def get(self, key: str) -> tuple[int, float | None] | None:
        return self._entries.get(key)

    def remember(self, key: str, size: int, expires: float | None) -> None:
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                self._bytes -= old[0]
                self._n_ttl -= old[1] is not None
            self._entries[key] = (size, expires)
            self._bytes += size
            self._n_ttl += expires is not None
            if self._touched is not None:
                self._touched.add(key)

    def forget(self, key: str, missed: bool = False) -> None:
        """Drop `key`; `missed`: it vanished from the server without our delete (count why)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if self._touched is not None:
                self._touched.add(key)
            if old is None:
                return
            self._bytes -= old[0]
            self._n_ttl -= old[1] is not None
        if missed:
            if old[1] is not None and old[1] <= self.clock.monotonic():
                self.stats.expired += 1
            else:
                self.stats.evictions += 1

    def purge_expired(self) -> None:
        if not self._n_ttl:
            return
        now = self.clock.monotonic()
        with self._lock:
            gone = [k for k, (_, exp) in self._entries.items() if exp is not None and exp <= now]
        for key in gone:
            self.forget(key, missed=True)

    def usage(self) -> int:
        self.purge_expired()
        return self._bytes

    def __len__(self) -> int:
        self.purge_expired()
        return len(self._entries)

    def begin_rebuild(self) -> None:
        """From now until `finish_rebuild`, remember which keys change (they win over the scan)."""
        with self._lock:
            self._touched = set()

    def finish_rebuild(self, found: Sizes, scanned: set[str], owner: Callable[[str], str | None]) -> None:
        """Replace the view by `found`, what a scan of the servers named in `scanned` returned.
        `owner(key)` names a key's server: what we knew about servers not scanned stays as it was."""
        with self._lock:
            touched, self._touched = self._touched or set(), None
            keep = {
                k: v
                for k, v in self._entries.items()
                if not scanned or k in touched or owner(k) not in scanned
            }
            found = {k: v for k, v in found.items() if k not in touched}
            self._entries = {**found, **keep}
            self._bytes = sum(size for size, _ in self._entries.values())
            self._n_ttl = sum(exp is not None for _, exp in self._entries.values())


def scan_sizes(client: redis.Redis, raw_prefix: bytes, clock: Clock = SYSTEM) -> Sizes:
    """Every key under `raw_prefix` on this server, with its size and expiry (SCAN, STRLEN + PTTL)."""
    out: Sizes = {}
    batch: list[bytes] = []
    for rkey in client.scan_iter(match=glob_escape(raw_prefix) + b"*", count=SCAN_BATCH):
        batch.append(rkey)
        if len(batch) == SCAN_BATCH:
            _sizes(client, raw_prefix, batch, out, clock)
            batch = []
    if batch:
        _sizes(client, raw_prefix, batch, out, clock)
    return out


def _sizes(client: redis.Redis, raw_prefix: bytes, rkeys: list[bytes], out: Sizes, clock: Clock) -> None:
    pipe = client.pipeline(transaction=False)
    for rkey in rkeys:
        pipe.strlen(rkey)
        pipe.pttl(rkey)
    replies = pipe.execute()
    now = clock.monotonic()
    for rkey, size, pttl in zip(rkeys, replies[::2], replies[1::2], strict=True):
        if pttl == -2:  # gone since the SCAN
            continue
        try:
            key = rkey[len(raw_prefix) :].decode()
        except UnicodeDecodeError:
            continue
        out[key] = (size, now + pttl / 1000 if pttl >= 0 else None)


def glob_escape(raw: bytes) -> bytes:
    """`raw` as a literal in a SCAN MATCH pattern."""
    for ch in (b"\\", b"*", b"?", b"[", b"]"):
        raw = raw.replace(ch, b"\\" + ch)
    return raw
