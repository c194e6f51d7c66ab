"""A shared tier's invalidations on disk (hinted handoff, kvstore/tiers/handoff/), so that a restart
keeps them: a delete or replace made while the backend (Redis, a shared directory) was out of reach is
never undone by restarting this process.

A directory per backend (`TierContext.handoff_dir`: per Redis URL and prefix, per shared directory) holds slots `<n>.log` (records) and `<n>.lock` (flock'ed while a
process owns the slot: several processes with the same Redis and prefix each take their own).
A log starts with a header line (its format's version) and holds one record a line: `+<key> <crc>`
(invalidated) or `-<key> <crc>` (deleted on the server, or overwritten there: forgotten), `<crc>` the
CRC-32 of what precedes it, 8 hex digits. Every append is fsync'd before it returns, so an
invalidation is acknowledged only once it would survive a crash or a restart; an append that fails
(a full disk, an I/O error) is cut off again before it raises, and the next append first cuts any
bytes past the last whole record, so a refused write changes nothing and never runs into the next
record. A reader keeps the records whose checksum holds and drops a torn tail (a crash mid-append)
and any line that does not check (never acknowledged). A log without the header is the older format
(lines without checksums): read as it was written, then rewritten in this one.

On open a process takes the first free slot and merges into it every slot no live process holds (the
keys of a process that stopped with keys still waiting): the merged set is written to a temp file,
fsync'd and renamed over its slot's log, and only then are the other logs removed. The log is
rewritten the same way when it holds far more records than waiting keys, emptied when none wait, and
removed when the process closes it with none waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.tiers.disk_files import fsync_dir

log = logging.getLogger("kvstore.tiers.handoff")
MAX_SLOTS = 64  # processes sharing one backend on one host, with the same state directory
COMPACT_SLACK = 4096  # records beyond twice the waiting keys before the log is rewritten
HEADER = b"kvstore handoff journal v2\n"


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _record(op: bytes, key: str) -> bytes:
    body = op + key.encode()
    if b"\n" in body:
        raise OSError(f"a key with a newline cannot be journaled: {body[:80]!r}")
    return body + b" %08x\n" % zlib.crc32(body)


def _parse(data: bytes) -> list[bytes]:
    """The records (`+key` / `-key`) of a log's bytes whose checksums hold, in order."""
    if not data.startswith(HEADER):  # the older format: no header, no checksums
        return [line for line in data.split(b"\n")[:-1] if line[:1] in (b"+", b"-")]
    records, bad = [], 0
    for line in data[len(HEADER) :].split(b"\n")[:-1]:  # after the last newline: torn (or empty)
        body, _, crc = line.rpartition(b" ")
        if len(crc) == 8 and body[:1] in (b"+", b"-") and crc == b"%08x" % zlib.crc32(body):
            records.append(body)
        else:
            bad += 1
    if bad:
        log.warning("%d torn or garbled records in an invalidation journal were dropped", bad)
    return records


def _read(path: Path) -> dict[str, None]:
    """The keys whose last record in `path` is `+`, in order of their records."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    keys: dict[str, None] = {}
    for record in _parse(data):
        key = record[1:].decode(errors="replace")
        if record[:1] == b"+":
            keys[key] = None
        else:
            keys.pop(key, None)
    return keys


class Journal:
    """One process's slot of invalidated keys on disk. Not thread-safe: Invalidations serialises it."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd, self.path = self._claim()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConfigError(
                f"cannot keep a tier's invalidations in {self.dir}: {e} (set state_dir, "
                "--state-dir or KVSTORE_STATE_DIR to a writable directory)"
            ) from None
        self._records = 0  # records in the log now
        self._live = 0  # keys waiting (as the caller last told us)
        self._size: int | None = None  # bytes of whole records in the log (known once load() wrote it)
        self._torn = False  # a failed append may have left bytes past _size

    def _claim(self) -> tuple[int, Path]:
        for n in range(MAX_SLOTS):
            fd = _lock(self.dir / f"{n}.lock")
            if fd is not None:
                return fd, self.dir / f"{n}.log"
        raise ConfigError(f"all {MAX_SLOTS} invalidation slots in {self.dir} are in use by other processes")

    def load(self) -> list[str]:
        """The keys waiting in this slot and in every slot no live process holds; those are merged into
        this one (durably) and removed."""
        keys = _read(self.path)
        orphans: list[tuple[Path, int]] = []
        for lock in sorted(self.dir.glob("*.lock")):
            other = lock.with_suffix(".log")
            if other == self.path or not other.exists():
                continue
            fd = _lock(lock)
            if fd is None:
                continue  # a live process's
            keys.update(_read(other))
            orphans.append((other, fd))
        try:
            self.rewrite(keys)
            for path, _ in orphans:
                path.unlink(missing_ok=True)
            if orphans:
                fsync_dir(self.dir)
        except OSError as e:
            raise ConfigError(f"cannot rewrite the invalidations in {self.dir}: {e}") from None
        finally:
            for _, fd in orphans:
                os.close(fd)
        if keys:
            log.warning("%d invalidations from before the restart wait for the backend (%s)",
                        len(keys), self.dir)  # fmt: skip
        return list(keys)

    def _write(self, data: bytes) -> None:
        """Append `data` durably, or raise OSError having left the log as it was."""
        assert self._size is not None, "load() first"
        if self._torn:  # cut what a failed append left before writing after it
            os.ftruncate(self._fd, self._size)
            self._torn = False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError:
            self._torn = True
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
                os.fsync(self._fd)
                self._torn = False
            raise
        self._size += len(data)

    def append(self, added: Iterable[str] = (), removed: Iterable[str] = (), live: int = 0) -> None:
        """Record `added` and `removed` keys, durably (raises OSError when it could not, and then the
        log is as it was); `live`: how many keys wait after this (the log is emptied at 0, rewritten
        when it holds far more)."""
        lines = [_record(b"+", k) for k in added] + [_record(b"-", k) for k in removed]
        if live == 0 and not any(line[:1] == b"+" for line in lines):
            if self._size:
                os.ftruncate(self._fd, 0)
                os.fsync(self._fd)
            self._size, self._torn = 0, False
            self._records = self._live = 0
            return
        self._write((HEADER if not self._size else b"") + b"".join(lines))
        self._records += len(lines)
        self._live = live

    def needs_rewrite(self) -> bool:
        return self._records > 2 * self._live + COMPACT_SLACK

    def rewrite(self, keys: Iterable[str]) -> None:
        """Replace the log by one record per waiting key (temp file, fsync, rename, fsync dir)."""
        keys = list(keys)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = HEADER + b"".join(_record(b"+", k) for k in keys) if keys else b""
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        fsync_dir(self.dir)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._size, self._torn = len(data), False
        self._records = self._live = len(keys)

    def close(self, waiting: int) -> None:
        """Release the slot; with no key `waiting`, remove its files (and the directory once empty)."""
        if waiting == 0 and self._lock_fd >= 0:
            for path in (self.path, self.path.with_suffix(".lock")):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another process's slot is still there
                self.dir.rmdir()
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
