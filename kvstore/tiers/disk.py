"""The `disk` tier: one file per blob under a sharded directory, crash-safe, warm restart.

On-disk layout (the index is only ever rebuilt from this, there is no separate journal):

    <root>/ab/cd/<key>             a blob without expiry (ab, cd = the key's first 4 hex characters)
    <root>/ab/cd/<key>.x<ms>       a blob that expires at <ms> (Unix time in milliseconds)
    <root>/ab/cd/.tmp-<...>        a write in progress; deleted on start

A put writes the temp file, fsyncs it, renames it to its real name and fsyncs the directory; `put`
returns only after that, so an acknowledged blob survives a crash, and a crash never leaves a
half-written file under a real name. Recency is the file's mtime: a put sets it and a get refreshes
it, so the LRU order survives a restart. The TTL lives in the file name (not in the blob, which the
tier never parses), so expiry survives a restart too; an expired blob is deleted when met.
Usage counts blob bytes exactly (file sizes), not temp files in flight or file-system overhead.

The directory is flock'ed while a DiskTier owns it. The index follows the files, not the other way
round: a read (get, contains) that finds a blob's file gone or replaced by something that is not a
regular file drops it from the index, so HEAD, exists and lookup agree with GET. A write that cannot
be done (ENOSPC, EMFILE, any OSError) raises TierWriteError and removes any older blob of the key; a
read error of a blob it holds raises TierReadError: an error, never a miss that hides one. File
operations that a hostile or broken directory cannot trip: kvstore/tiers/disk_files.py.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
from pathlib import Path

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import InvalidArgument
from kvstore.keys import validate_key
from kvstore.lru import Entry, LRUIndex, check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.base import TOO_LARGE, TierReadError, TierStats, TierWriteError, os_detail, os_reason
from kvstore.tiers.disk_files import (
    TMP_PREFIX,
    NotRegular,
    fsync_dir,
    is_regular,
    lock_directory,
    make_dirs,
    parse_name,
    read_regular,
    write_new,
)
from kvstore.tiers.indexed import IndexedTier

logger = logging.getLogger(__name__)
__all__ = ["DiskTier", "TMP_PREFIX", "parse_name"]


class DiskTier(IndexedTier):
    """File-per-blob tier. Thread-safe: the index is under one lock; file data moves outside it."""

    def __init__(
        self, path: str | Path, capacity: int, name: str = "disk", fsync: bool = True, clock: Clock = SYSTEM
    ) -> None:
        """`clock`: the store's; expiry times are on its `time` (wall clock: they live in file names)."""
        if capacity <= 0:
            raise InvalidArgument(f"disk tier capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.root = Path(path)
        self.fsync = fsync
        self.stats = TierStats()
        self._clock, self._clock_ns = clock.time, clock.time_ns  # mtimes (LRU order) too
        self._lock = threading.Lock()
        self._index: LRUIndex[str] = LRUIndex(capacity)  # value: file name inside the shard dir
        self._tmp_ids = itertools.count()
        self._shards_made: set[Path] = set()
        self._ttl_seen = False  # sweep expired blobs on put only once some blob has a TTL
        self._lock_fd = lock_directory(self.root)
        self._load()

    # -- layout ------------------------------------------------------------------------------------

    def _shard(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4]

    def _path(self, key: str, fname: str) -> Path:
        return self._shard(key) / fname

    def _load(self) -> None:
        """Rebuild the index from the directory: drop temp leftovers and expired blobs, order by mtime."""
        found: dict[str, tuple[int, int, str]] = {}  # key -> (mtime_ns, size, file name)
        now_ms = self._clock() * 1000
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
            try:
                st = path.lstat()
            except OSError as e:
                logger.warning("disk tier: ignoring %r: %s", str(path), e)
                continue
            if not stat.S_ISREG(st.st_mode):
                logger.warning("disk tier: ignoring %r: not a regular file", str(path))
                continue
            if expiry_ms is not None and expiry_ms <= now_ms:
                path.unlink(missing_ok=True)
                self.stats.expired += 1
                continue
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

    def _unlink(self, entries: list[tuple[str, Entry[str]]]) -> list[str]:
        """Delete the entries' files; returns the keys whose file could not be deleted."""
        stuck = []
        for key, entry in entries:
            try:
                self._path(key, entry.value).unlink(missing_ok=True)
            except OSError as e:
                self.stats.errors += 1
                stuck.append(key)
                logger.error("disk tier: cannot delete %s: %s (it would come back on restart)", key, e)
        return stuck

    def _drop(self, key: str, entry: Entry[str], why: str) -> None:
        """The index said `entry`, the directory disagrees: the directory wins."""
        with self._lock:
            if self._index.peek(key) is entry:
                self._index.pop(key)
                self.stats.errors += 1
                logger.warning("disk tier: %s %s; dropped from the index", key, why)

    def _make_shard(self, shard: Path) -> None:
        if shard not in self._shards_made:
            make_dirs(shard, self.fsync)
            self._shards_made.add(shard)

    # -- the Tier protocol -------------------------------------------------------------------------

    def _live_entry(self, key: str, touch: bool) -> Entry[str] | None:
        """Under the lock: the entry, or None (an expired one is removed)."""
        entry = self._index.peek(key)
        if entry is None:
            return None
        if entry.expired(self._clock()):
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
            return read_regular(path, self._clock_ns())  # mtime = last use: the order a restart rebuilds
        except FileNotFoundError:
            self._drop(key, entry, "was deleted behind our back")
        except NotRegular as e:
            self._drop(key, entry, str(e))
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._drop(key, entry, "was replaced by a symlink")
                return None
            self.stats.errors += 1
            logger.warning("disk tier: cannot read %s: %s", path, e)
            raise TierReadError(self.name, [key], f"cannot read {key}: {os_detail(e)}", [None]) from None
        return None

    def get_many(self, keys: list[str]) -> list[Blob | None]:  # type: ignore[override]
        out: list[Blob | None] = []
        failed: list[str] = []
        detail = ""
        for key in keys:
            try:
                out.append(self.get(key))
            except TierReadError as e:
                out.append(None)
                failed.append(key)
                detail = e.detail
        if failed:
            raise TierReadError(self.name, failed, detail, out)
        return out

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        validate_key(key)  # the key becomes a file name
        check_ttl(ttl_s)
        view = memoryview(blob).cast("B")
        size = len(view)
        if size > self.capacity:
            stale = self._forget(key)
            raise TierWriteError(
                self.name,
                {key: TOO_LARGE},
                f"blob of {size} bytes is over its capacity {self.capacity}",
                stale,
            )
        shard = self._shard(key)
        tmp = shard / f"{TMP_PREFIX}{key}-{os.getpid()}-{next(self._tmp_ids)}"
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        fname = key if expires_at is None else f"{key}.x{int(expires_at * 1000)}"
        try:
            self._make_shard(shard)
            write_new(shard, tmp, view, self.fsync, self._clock_ns())
            with self._lock:
                self._ttl_seen = self._ttl_seen or expires_at is not None
                if self._ttl_seen:  # a cheap sweep of the oldest entries
                    expired = self._index.pop_expired(self._clock())
                    self._unlink(expired)
                    self.stats.expired += len(expired)
                os.rename(tmp, shard / fname)
                old, evicted = self._index.insert(key, Entry(size, fname, expires_at))
                if old is not None and old.value != fname:
                    self._unlink([(key, old)])
                self._unlink(evicted)
                self.stats.evictions += len(evicted)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.stats.errors += 1
            self.stats.dropped_puts += 1
            logger.warning("disk tier: cannot write %s: %s", key, e)
            stale = self._forget(key)  # never serve an older blob of a key whose put failed
            raise TierWriteError(self.name, {key: os_reason(e)}, os_detail(e), stale) from None
        if self.fsync:
            try:
                fsync_dir(shard)  # makes the rename durable
            except OSError as e:  # stored and readable, only its durability is in doubt
                self.stats.errors += 1
                logger.warning("disk tier: cannot fsync %s: %s", shard, e)
        return [k for k, _ in evicted]

    def _forget(self, key: str) -> list[str]:
        """Drop `key` and its file; returns [key] when the file stays (it would come back on restart)."""
        with self._lock:
            entry = self._index.pop(key)
            return self._unlink([(key, entry)]) if entry is not None else []

    def contains(self, key: str) -> bool:
        with self._lock:
            entry = self._live_entry(key, touch=False)
        if entry is None:
            return False
        try:
            if is_regular(self._path(key, entry.value)):
                return True
            self._drop(key, entry, "is not a regular file")
        except FileNotFoundError:
            self._drop(key, entry, "was deleted behind our back")
        except OSError:  # cannot tell (EACCES...): a get will say what it is
            return True
        return False

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._index.pop(key)
            stuck = self._unlink([(key, entry)]) if entry is not None else []
        if stuck:
            raise TierWriteError(self.name, {}, f"cannot delete {key}", stale=stuck)
        return entry is not None

    def close(self) -> None:
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1
