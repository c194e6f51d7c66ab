"""The `disk` tier: one file per blob under a sharded directory, crash-safe, warm restart.

On-disk layout (the index is only ever rebuilt from this, there is no separate journal):

    <root>/.lock                   flock'ed while a DiskTier owns the directory
    <root>/ab/cd/<key>             a blob without expiry (ab, cd = the key's first 4 hex characters)
    <root>/ab/cd/<key>.x<ms>       a blob that expires at <ms> (Unix time in milliseconds)
    <root>/ab/cd/.tmp-<...>        a write in progress; deleted on start

A put writes the temp file, fsyncs it, renames it to its real name and fsyncs the directory; `put`
returns only after that, so an acknowledged blob survives a crash, and a crash never leaves a
half-written file under a real name. Recency is the file's mtime: a put sets it and a get refreshes
it, so the LRU order survives a restart. The TTL lives in the file name (not in the blob, which the
tier never parses), so expiry survives a restart too; an expired blob is deleted when met.
Usage counts blob bytes exactly (file sizes), not temp files in flight or file-system overhead.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import threading
import time
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.keys import is_key, validate_key
from kvstore.lru import Entry, LRUIndex, check_ttl
from kvstore.tiers.base import Blob, TierStats
from kvstore.tiers.indexed import IndexedTier

logger = logging.getLogger(__name__)
_EXPIRY_RE = re.compile(r"[0-9]{1,20}")
TMP_PREFIX = ".tmp-"


def parse_name(name: str) -> tuple[str, int | None] | None:
    """(key, expiry ms or None) of a blob file name `<key>` or `<key>.x<ms>`; None for any other name
    (never a near miss: "<key>\n" is not `<key>`)."""
    key, sep, expiry = name.partition(".x")
    if not is_key(key) or (sep and _EXPIRY_RE.fullmatch(expiry) is None):
        return None
    return key, int(expiry) if sep else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier(IndexedTier):
    """File-per-blob tier. Thread-safe: the index is under one lock; file data moves outside it."""

    _clock = staticmethod(time.time)  # expiry times are wall-clock: they live in file names

    def __init__(self, path: str | Path, capacity: int, name: str = "disk", fsync: bool = True) -> None:
        if capacity <= 0:
            raise InvalidArgument(f"disk tier capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.root = Path(path)
        self.fsync = fsync
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: LRUIndex[str] = LRUIndex(capacity)  # value: file name inside the shard dir
        self._tmp_ids = itertools.count()
        self._shards_made: set[Path] = set()
        self._ttl_seen = False  # sweep expired blobs on put only once some blob has a TTL
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot use {self.root} for the disk tier: {e}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(
                f"{self.root} is in use by another process (a kvstore-server, engine or Store.local with the "
                "same disk path): stop it, or give this store its own directory (disk_path=, --disk-path, "
                "KVSTORE_DISK_PATH)"
            ) from None
        self._load()

    @classmethod
    def from_config(cls, config: StoreConfig) -> DiskTier:
        return cls(config.disk_path, config.disk_capacity)

    # -- layout ------------------------------------------------------------------------------------

    def _shard(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4]

    def _path(self, key: str, fname: str) -> Path:
        return self._shard(key) / fname

    def _load(self) -> None:
        """Rebuild the index from the directory: drop temp leftovers and expired blobs, order by mtime."""
        found: dict[str, tuple[int, int, str]] = {}  # key -> (mtime_ns, size, file name)
        now_ms = time.time() * 1000
        for path in self.root.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*"):
            name = path.name
            if name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
                continue
            parsed = parse_name(name)
            if parsed is None or path.parent != self._shard(parsed[0]):
                logger.warning("disk tier: ignoring %r: not a blob file name", str(path))
                continue
            key, expiry_ms = parsed
            if expiry_ms is not None and expiry_ms <= now_ms:
                path.unlink(missing_ok=True)
                self.stats.expired += 1
                continue
            st = path.stat()
            if key in found:  # a crash between a rename and the unlink of the old name: keep the newer
                older = min(found[key], (st.st_mtime_ns, st.st_size, name))
                self._path(key, older[2]).unlink(missing_ok=True)
                if older[2] == name:
                    continue
            found[key] = (st.st_mtime_ns, st.st_size, name)
        for key, (_, size, name) in sorted(found.items(), key=lambda kv: kv[1][0]):
            if size > self.capacity:
                self._path(key, name).unlink(missing_ok=True)
                continue
            parsed = parse_name(name)
            assert parsed is not None
            expires_at = None if parsed[1] is None else parsed[1] / 1000
            self._ttl_seen = self._ttl_seen or expires_at is not None
            _, evicted = self._index.insert(key, Entry(size, name, expires_at))
            self._unlink(evicted)
            self.stats.evictions += len(evicted)
        logger.info("disk tier %s: %d blobs, %d bytes", self.root, len(self._index), self._index.used)

    def _unlink(self, entries: list[tuple[str, Entry[str]]]) -> None:
        for key, entry in entries:
            try:
                self._path(key, entry.value).unlink(missing_ok=True)
            except OSError as e:
                self.stats.errors += 1
                logger.warning("disk tier: cannot delete %s: %s", key, e)

    def _make_shard(self, shard: Path) -> None:
        if shard in self._shards_made:
            return
        if not shard.is_dir():
            shard.mkdir(parents=True, exist_ok=True)
            if self.fsync:
                _fsync_dir(shard.parent)
                _fsync_dir(shard.parent.parent)
        self._shards_made.add(shard)

    # -- the Tier protocol -------------------------------------------------------------------------

    def _live_entry(self, key: str, touch: bool) -> Entry[str] | None:
        """Under the lock: the entry, or None (an expired one is removed)."""
        entry = self._index.peek(key)
        if entry is None:
            return None
        if entry.expired(time.time()):
            self._index.pop(key)
            self._unlink([(key, entry)])
            self.stats.expired += 1
            return None
        if touch:
            self._index.touch(key)
        return entry

    def get(self, key: str) -> Blob | None:
        with self._lock:
            entry = self._live_entry(key, touch=True)
            if entry is None:
                return None
            path = self._path(key, entry.value)
        try:
            with open(path, "rb", buffering=0) as f:
                data = f.readall()
                os.utime(f.fileno())  # mtime = last use: the LRU order a restart rebuilds
        except FileNotFoundError:
            return None  # deleted or evicted since we looked
        except OSError as e:
            self.stats.errors += 1
            logger.warning("disk tier: cannot read %s: %s", path, e)
            return None
        return data

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        validate_key(key)  # the key becomes a file name
        check_ttl(ttl_s)
        view = memoryview(blob).cast("B")
        size = len(view)
        if size > self.capacity:
            self.delete(key)
            return []
        shard = self._shard(key)
        tmp = shard / f"{TMP_PREFIX}{key}-{os.getpid()}-{next(self._tmp_ids)}"
        expires_at = None if ttl_s is None else time.time() + ttl_s
        fname = key if expires_at is None else f"{key}.x{int(expires_at * 1000)}"
        try:
            self._make_shard(shard)
            self._write_file(tmp, view)
            with self._lock:
                self._ttl_seen = self._ttl_seen or expires_at is not None
                if self._ttl_seen:  # a cheap sweep of the oldest entries
                    expired = self._index.pop_expired(time.time())
                    self._unlink(expired)
                    self.stats.expired += len(expired)
                os.rename(tmp, shard / fname)
                old, evicted = self._index.insert(key, Entry(size, fname, expires_at))
                if old is not None and old.value != fname:
                    self._unlink([(key, old)])
                self._unlink(evicted)
                self.stats.evictions += len(evicted)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.stats.errors += 1
            self.stats.dropped_puts += 1
            logger.warning("disk tier: cannot write %s: %s", key, e)
            return []
        if self.fsync:
            try:
                _fsync_dir(shard)  # makes the rename durable
            except OSError as e:  # stored and readable, only its durability is in doubt
                self.stats.errors += 1
                logger.warning("disk tier: cannot fsync %s: %s", shard, e)
        return [k for k, _ in evicted]

    def _write_file(self, tmp: Path, view: memoryview) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._live_entry(key, touch=False) is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._index.pop(key)
            if entry is not None:
                self._unlink([(key, entry)])
        return entry is not None

    def close(self) -> None:
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1
