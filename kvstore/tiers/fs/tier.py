"""The `fs` tier: one directory that several kvstore-servers share, as on NFS or Lustre (docs/design.md §4).

Written against the plug-in API alone (kvstore/tier_registry.py declares it: shared, durable, medium
FS, hinted handoff). Files, publishing and removal by identity: files.py; sweeps: sweep.py.

- A put publishes the whole file by write-then-rename: a reader, on any server, opens the key's name
  and reads the old file or the new one, never half of one; a writer killed mid-write leaves a temp
  file no reader opens (swept later). Acknowledged once the file and the rename are fsync'd.
- Every file is bound to its key: its header names the key (a file under another key's name is a
  miss), and the blob in it is bound to the key as the store binds every blob (kvstore/blob.py).
- TTLs live in the header (on the store's clock), so every server and a restart read them.
- A delete writes a tombstone; reads treat it as a miss; sweeps remove it later.
- Capacity: `usage()` and `len()` are this server's view (its own puts, its reads, the last sweep's
  listing), kept within `capacity` at every put by evicting its least recently used blobs. The
  directory as a whole is kept within it by sweeps, which every server runs (sweep.py), with
  eviction by age (`max_age`). Every removal goes by identity: a blob another server replaced or
  used meanwhile stays.
- Outages (the mount gone, EIO, ESTALE...): a read is a miss, counted in `stats.errors`; a put raises
  TierWriteError; a delete, or a failed put's older blob, that cannot be removed is invalidated and
  replayed when the directory answers (hinted handoff, kvstore/tiers/handoff/, journaled under the
  state directory): never an older blob served.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import InvalidArgument
from kvstore.keys import is_key, validate_key
from kvstore.lru import Entry, LRUIndex, check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.base import NO_SPACE, TOO_LARGE, TierStats, TierWriteError, os_detail, os_reason
from kvstore.tiers.fs import files, sweep
from kvstore.tiers.fs.files import FileId, Foreign
from kvstore.tiers.handoff import Handoff, Journal

log = logging.getLogger("kvstore.tiers.fs")


class FsTier:
    """Blobs as files in a directory other servers share. Thread-safe."""

    def __init__(
        self,
        path: str | Path,
        capacity: int,
        name: str = "fs",
        max_age: float | None = None,
        sweep_interval: float | None = 30.0,
        fsync: bool = True,
        max_invalidated: int = 100_000,
        handoff_dir: str | Path | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """`sweep_interval`: seconds between this server's sweeps (None: only when `sweep()` is called);
        `handoff_dir`: where invalidations survive a restart (None: in memory only)."""
        if capacity <= 0:
            raise InvalidArgument(f"fs tier capacity must be positive, got {capacity}")
        if max_age is not None and max_age <= 0:
            raise InvalidArgument(f"fs tier max_age must be positive, got {max_age}")
        self.name, self.capacity, self.root = name, capacity, Path(path)
        self.max_age, self.fsync, self.clock = max_age, fsync, clock
        self.stats = TierStats()
        for k in ("foreign", "kept_by_identity", "swept_files", "swept_bytes"):
            self.stats.extra[k] = 0
        self._lock = threading.Lock()
        self._index: LRUIndex[FileId] = LRUIndex(capacity)
        journal = Journal(handoff_dir) if handoff_dir is not None else None
        self._invalid = Handoff(
            max_invalidated, self._tombstones, f"fs tier {self.root}", self.stats, journal
        )
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        try:
            files.claim(self.root)
            self._reindex(sweep.list_directory(self.root), since_ns=None)
        except OSError as e:  # out of reach now: it may come back; reads miss meanwhile
            self._unreachable("list", str(self.root), e)
        if sweep_interval is not None:
            self._sweeper = threading.Thread(
                target=self._sweep_loop, args=(sweep_interval,), name="fs-tier-sweep", daemon=True
            )
            self._sweeper.start()

    def _path(self, key: str) -> Path:
        return files.shard(self.root, key) / key

    def _unreachable(self, op: str, key: str, e: OSError) -> None:
        self.stats.errors += 1
        log.warning("fs tier %s: cannot %s %s: %s", self.root, op, key, os_detail(e))

    # ---- the index (this server's view) -----------------------------------------------------------

    def _seen(self, key: str, size: int, ident: FileId, expires: float | None) -> None:
        """A read found `key`'s blob: refresh the entry this server has of it (none: the next sweep's)."""
        with self._lock:
            entry = self._index.peek(key)
            if entry is not None and entry.size == size:
                own = entry.value.own and entry.value.ino == ident.ino
                entry.value, entry.expires_at = replace(ident, own=own), expires
                self._index.touch(key)
                return
        if entry is not None:  # replaced by another server with a blob of another size
            self._remember(key, size, ident, expires)

    def _remember(self, key: str, size: int, ident: FileId, expires: float | None) -> list[str]:
        with self._lock:
            _, evicted = self._index.insert(key, Entry(size, ident, expires))
        grace = self.clock.time_ns() - int(sweep.GRACE_S * 1e9)
        removed = []
        for k, e in evicted:  # least recently used in this server's view: removed unless replaced since,
            if (e.value.own or e.value.mtime_ns < grace) and self._remove(k, e.value):  # or another's fresh
                removed.append(k)
        self.stats.evictions += len(removed)
        return removed

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.pop(key)

    def _remove(self, key: str, ident: FileId | None) -> bool:
        try:
            if files.remove_if(self._path(key), ident):
                return True
            self.stats.extra["kept_by_identity"] += 1
        except OSError as e:
            self._unreachable("remove", key, e)
        return False

    # ---- reads -------------------------------------------------------------------------------------

    def get(self, key: str) -> Blob | None:
        if not is_key(key) or key in self._invalid:
            return None
        now = self.clock.time_ns()
        try:
            data, ident = files.read(self._path(key), now, int(sweep.TOUCH_S * 1e9))
            head = files.parse_header(data, key)
        except FileNotFoundError:
            self._forget(key)
            return None
        except Foreign as e:
            self._foreign(key, e)
            return None
        except OSError as e:
            self._unreachable("read", key, e)
            return None
        if head.tombstone or self._expired(key, head.expires, ident):
            return None
        self._seen(key, len(data) - head.size, ident, head.expires)
        return memoryview(data)[head.size :]

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        return [self.get(k) for k in keys]

    def _foreign(self, key: str, e: Foreign) -> None:
        self.stats.extra["foreign"] += 1
        self._forget(key)
        log.warning("fs tier %s: the file of %s is not its: %s (a miss)", self.root, key, e)

    def _expired(self, key: str, expires: float | None, ident: FileId) -> bool:
        if expires is None or expires > self.clock.time():
            return False
        self.stats.expired += 1
        self._forget(key)
        self._remove(key, ident)
        return True

    def contains(self, key: str) -> bool:
        if not is_key(key) or key in self._invalid:
            return False
        try:
            head, ident = files.read_head(self._path(key), key)
        except FileNotFoundError:
            self._forget(key)
            return False
        except Foreign as e:
            self._foreign(key, e)
            return False
        except OSError as e:
            self._unreachable("stat", key, e)
            return False
        return not head.tombstone and not self._expired(key, head.expires, ident)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def keys(self) -> Iterator[str]:
        """The keys of every blob in the directory now (all servers'), listed and their headers read."""
        try:
            listing = sweep.list_directory(self.root)
        except OSError as e:
            self._unreachable("list", str(self.root), e)
            return iter([])
        now, out = self.clock.time(), []
        for key, found in listing.found.items():
            if found.tombstone or key in self._invalid:
                continue
            with contextlib.suppress(OSError, Foreign):
                head, _ = files.read_head(self._path(key), key)
                if not head.tombstone and (head.expires is None or head.expires > now):
                    out.append(key)
        return iter(out)

    def usage(self) -> int:
        """Blob bytes in this server's view of the directory (see the module docstring)."""
        return self._index.used

    def __len__(self) -> int:
        return len(self._index)

    # ---- writes ------------------------------------------------------------------------------------

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        return self.put_many([(key, blob)], ttl_s)

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        check_ttl(ttl_s)
        for key, _ in items:
            validate_key(key)  # the key becomes a file name
        evicted: list[str] = []
        failed: dict[str, str] = {}
        details: list[str] = []
        stale: list[str] = []
        for key, blob in items:
            try:
                evicted += self._put(key, memoryview(blob).cast("B"), ttl_s)
            except TierWriteError as e:
                failed.update(e.failed)
                details.append(e.detail)
                stale += e.stale
        if failed:
            shown = list(dict.fromkeys(details))
            raise TierWriteError(self.name, failed, "; ".join(shown[:3]), stale, evicted)
        return evicted

    def _put(self, key: str, view: memoryview, ttl_s: float | None) -> list[str]:
        size = len(view)
        if size > self.capacity:
            stale = self._erase(key)  # the older blob goes: no put leaves one behind
            detail = f"blob of {size} bytes is over its capacity {self.capacity}"
            raise TierWriteError(self.name, {key: TOO_LARGE}, detail, stale)
        expires = None if ttl_s is None else self.clock.time() + ttl_s
        gen = self._invalid.generation(key) if len(self._invalid) else None
        try:  # a replayed tombstone of the key and this put never cross
            with self._invalid.replay_lock if gen is not None else contextlib.nullcontext():
                head = files.encode_header(key, expires)
                ident = files.publish(self.root, key, [head, view], self.clock.time_ns(), self.fsync)
        except OSError as e:
            self.stats.errors += 1
            self.stats.dropped_puts += 1
            log.warning("fs tier %s: cannot write %s: %s", self.root, key, os_detail(e))
            stale = self._erase(key)  # never serve the older blob of a key whose put failed
            raise TierWriteError(self.name, {key: os_reason(e)}, os_detail(e), stale) from None
        if gen is not None:
            self._invalid.discard(key, gen)  # the new blob replaced what the tombstone was for
        return self._remember(key, size, ident, expires)

    def _tombstone(self, key: str) -> None:
        """Publish a tombstone over `key` (OSError when it could not: unreachable, or a full disk)."""
        files.publish(
            self.root, key, [files.encode_header(key, None, True)], self.clock.time_ns(), self.fsync
        )

    def _erase(self, key: str) -> list[str]:
        """Make sure no older blob of `key` is served: a tombstone, else (a full disk) the file
        unlinked, else (unreachable) the key invalidated until a replay can. Returns [key] when none
        of these worked (the store then fails the request)."""
        self._forget(key)
        try:
            self._tombstone(key)
            return []
        except OSError as e:
            if os_reason(e) == NO_SPACE:
                with contextlib.suppress(OSError):
                    files.remove_if(self._path(key), None)
                    return []
        return self._invalid.add([key])

    def _tombstones(self, keys: list[str]) -> set[str]:
        """The replayer's delete: a tombstone for each key; those written."""
        done = set()
        for key in keys:
            try:
                self._tombstone(key)
                done.add(key)
            except OSError:
                break  # still out of reach: the next round
        return done

    def delete(self, key: str) -> bool:
        """A tombstone over the key's file (none needed when there is no file). True when a blob was
        there (or may be: the directory out of reach, the key remembered to delete later)."""
        validate_key(key)
        self._forget(key)
        try:
            head, _ = files.read_head(self._path(key), key)
            present = not head.tombstone
        except FileNotFoundError:
            if (self.root / files.MARKER).exists():
                return False
            present = True  # not our directory now (a lost mount's empty mount point): remember it
        except Foreign:
            present = True
        except OSError:  # out of reach: remember it (or say it is stale)
            present = True
        if not present:
            return False
        stale = self._erase(key)
        if stale:
            detail = f"cannot delete {key}: {self.root} is out of reach and {self._invalid.limit} keys wait"
            raise TierWriteError(self.name, {}, detail, stale=stale)
        return True

    # ---- sweeps ------------------------------------------------------------------------------------

    def sweep(self) -> int:
        """One sweep of the directory (sweep.py); returns the files it removed."""
        started = self.clock.time_ns()
        listing = sweep.list_directory(self.root)
        now = self.clock.time()
        for path in sweep.stale_leftovers(listing, now):
            files.unlink_quietly(path)
        removed = 0
        for found in sweep.victims(listing, now, self.capacity, self.max_age):
            if self._remove(found.key, found.ident):
                removed += 1
                self.stats.extra["swept_files"] += 1
                self.stats.extra["swept_bytes"] += found.size
                if not found.tombstone:
                    self.stats.evictions += 1
            listing.found.pop(found.key, None)
        self._reindex(listing, since_ns=started)
        return removed

    def _reindex(self, listing: sweep.Listing, since_ns: int | None) -> None:
        """This server's view from a listing: its blobs by mtime; entries this server wrote or read
        since the listing began (`since_ns`) stay as they are."""
        index: LRUIndex[FileId] = LRUIndex(self.capacity)
        blobs = sorted((f for f in listing.found.values() if not f.tombstone), key=lambda f: f.ident.mtime_ns)
        with self._lock:
            newer = [
                (k, e)
                for k, e in self._index.items()
                if since_ns is not None and e.value.mtime_ns >= since_ns
            ]
            for f in blobs:
                if f.size <= self.capacity:
                    index.insert(f.key, Entry(f.size, f.ident))
            for k, e in newer:
                index.pop(k)
                if e.size <= self.capacity:
                    index.insert(k, e)
            self._index = index

    def _sweep_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except OSError as e:
                self._unreachable("sweep", str(self.root), e)
            except Exception:  # the sweeper must outlive any one bad round
                log.exception("fs tier %s: sweep failed", self.root)

    def close(self) -> None:
        self._stop.set()
        if self._sweeper is not None and self._sweeper is not threading.current_thread():
            self._sweeper.join(30)
        self._invalid.close(timeout=30)
