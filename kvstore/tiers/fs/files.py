"""The fs tier's files: their format, publishing one, reading one, and removing one that several
servers may be replacing at the same moment (docs/design.md §4).

Layout of the shared directory:

    <root>/ab/<key>                      a blob, or a tombstone (ab: the key's first 2 hex characters)
    <root>/ab/.tmp-<key>-<host>-<pid>-<n>  a write in progress (one a crash left: swept after TMP_MAX_AGE_S)
    <root>/ab/.gone-<key>-<host>-<pid>-<n> a file being removed (moved aside; see `remove_if`)
    <root>/.kvstore-fs                   the marker: a shard directory is made only where it is
                                         (never under the empty mount point of a lost mount)

A file is a header, then the blob: magic `KVFS`, version, flags (1: a tombstone, no blob), the key's
length, the expiry time (seconds since the epoch, 0: none), the key; the blob follows. The key in the
header binds the file to its name: a file renamed or copied under another key's name is refused
(`Foreign`); the blob inside is bound to its key too (the store checks that, kvstore/blob.py).

Publishing: write the whole file under a temp name in the key's shard directory, fsync it, set its
mtime (the writer's clock: what ages and LRU order across servers are read from), rename it over the
key's name, fsync the directory. A reader opens the name and gets the old file or the new one, whole;
a writer killed mid-write leaves only a temp file no reader opens.

Removing a file another server may have replaced since it was looked at (eviction, sweeps) goes by
identity, never by name alone: the name is renamed aside (atomic: whatever is there now), the file
moved is checked against the one meant, and removed only if it is that one; any other (a newer
blob, a tombstone) is linked back under the name unless something newer is there already. A delete
writes a tombstone rather than unlinking, so a file being put back cannot undo it; tombstones go once
they are older than TOMBSTONE_S, long after any such putting back (which gives up after RESTORE_S).
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.keys import is_key
from kvstore.tiers.disk_files import fsync_dir

MAGIC, VERSION, TOMBSTONE = b"KVFS", 1, 1
_HEAD = struct.Struct("<4sBBHd")  # magic, version, flags, key length, expiry (s since the epoch; 0: none)
TMP, GONE, MARKER = ".tmp-", ".gone-", ".kvstore-fs"
TMP_MAX_AGE_S = 3600.0  # a temp file this old is a crashed writer's
RESTORE_S = 10.0  # a file moved aside longer than this is not put back (a tombstone may be gone by then)
TOMBSTONE_S = 120.0  # a tombstone older than this is removed by a sweep
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ids = itertools.count()
_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


class Foreign(Exception):
    """A file under a key's name that is not that key's (another key's, not ours at all, torn)."""


@dataclass(frozen=True)
class FileId:
    """What tells one file from another that replaced it under the same name; `own`: this process
    wrote it (no part of the identity)."""

    ino: int
    mtime_ns: int
    size: int
    own: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class Header:
    key: str
    expires: float | None
    tombstone: bool
    size: int  # header bytes


def header_size(key: str) -> int:
    return _HEAD.size + len(key)


def encode_header(key: str, expires: float | None, tombstone: bool = False) -> bytes:
    flags = TOMBSTONE if tombstone else 0
    return _HEAD.pack(MAGIC, VERSION, flags, len(key), expires or 0.0) + key.encode()


def parse_header(data: bytes | memoryview, key: str) -> Header:
    """The header at the start of `data`; Foreign unless it is a version-1 header of `key`."""
    if len(data) < _HEAD.size:
        raise Foreign("shorter than a header")
    magic, version, flags, n, expires = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or len(data) < _HEAD.size + n:
        raise Foreign(f"not a kvstore fs file (magic {bytes(magic)!r}, version {version})")
    named = bytes(data[_HEAD.size : _HEAD.size + n]).decode("ascii", "replace")
    if named != key:
        raise Foreign(f"holds {named[:40]!r}")
    tombstone = bool(flags & TOMBSTONE)
    if tombstone and len(data) != _HEAD.size + n:
        raise Foreign("a tombstone with a payload")
    return Header(key, expires or None, tombstone, _HEAD.size + n)


def claim(root: Path) -> None:
    """Make `root` (and its marker, once: the first server) the fs tier's directory. Only at start: a
    put later makes a shard directory only under the marker."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return
    try:
        os.write(fd, b"kvstore fs tier, format 1\n")
    finally:
        os.close(fd)


def shard(root: Path, key: str) -> Path:
    return root / key[:2]


def temp_name(prefix: str, key: str) -> str:
    return f"{prefix}{key}-{_HOST}-{os.getpid()}-{next(_ids)}"


def parse_name(name: str) -> str | None:
    """The key a directory entry is the file of; None for temp files and strangers."""
    return name if is_key(name) else None


def publish(root: Path, key: str, parts: list[bytes | memoryview], mtime_ns: int, fsync: bool) -> FileId:
    """Write `parts` as the file of `key` (temp name, fsync, mtime, rename, fsync the directory); the
    published file's identity. OSError (the temp file removed) when it could not."""
    d = shard(root, key)
    tmp = d / temp_name(TMP, key)
    try:
        fd = os.open(tmp, _CREATE, 0o644)
    except FileNotFoundError:  # the shard directory is not there yet (or was removed)
        os.stat(root / MARKER)  # FileNotFoundError where the directory is not ours (a lost mount)
        d.mkdir(exist_ok=True)
        fd = os.open(tmp, _CREATE, 0o644)
    try:
        try:
            todo = [memoryview(p).cast("B") for p in parts]
            while todo:
                n = os.writev(fd, todo)
                while todo and n >= len(todo[0]):
                    n -= len(todo[0])
                    todo.pop(0)
                if todo:
                    todo[0] = todo[0][n:]
            if fsync:
                os.fsync(fd)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
            ident = replace(FileId.of(os.fstat(fd)), own=True)
        finally:
            os.close(fd)
        os.rename(tmp, d / key)
    except OSError:
        unlink_quietly(tmp)
        raise
    if fsync:
        fsync_dir(d)
    return ident


def read(path: Path, now_ns: int | None = None, slack_ns: int = 0) -> tuple[bytes, FileId]:
    """The whole file and its identity. With `now_ns`, a use: its mtime is set to `now_ns` first when
    it is older than `slack_ns` before (best effort: another owner's file keeps its mtime).
    FileNotFoundError when absent, Foreign when not a regular file, OSError otherwise."""
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Foreign("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Foreign(f"not a regular file ({stat.filemode(st.st_mode)})")
        if now_ns is not None and st.st_mtime_ns < now_ns - slack_ns:
            try:
                os.utime(fd, ns=(now_ns, now_ns))
                st = os.fstat(fd)
            except PermissionError:
                pass
        with open(fd, "rb", buffering=0, closefd=False) as f:
            data = f.readall()
        return data, FileId.of(st)
    finally:
        os.close(fd)


def read_head(path: Path, key: str) -> tuple[Header, FileId]:
    """The header of the file at `path` (of `key`) and its identity, reading no more than the header."""
    fd = os.open(path, _READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Foreign("not a regular file")
        return parse_header(os.pread(fd, header_size(key), 0), key), FileId.of(st)
    finally:
        os.close(fd)


def remove_if(path: Path, ident: FileId | None) -> bool:
    """Remove the file at `path` if it is `ident` (None: whatever is there). True when a file was
    removed (or was gone already); False when the file there is another one, which stays there."""
    aside = path.parent / temp_name(GONE, path.name)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # gone already (another server removed it)
    moved_at = time.monotonic()
    try:
        try:
            moved = FileId.of(os.lstat(aside))
        except FileNotFoundError:  # a sweep took it: it was old
            return True
        if ident is None or moved == ident:
            return True
        if time.monotonic() - moved_at < RESTORE_S:  # not that one: put it back unless a newer one came
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        return False
    finally:
        unlink_quietly(aside)


def unlink_quietly(path: Path) -> None:
    """Unlink `path` if it is there; a failure leaves a leftover that a sweep removes."""
    try:
        os.unlink(path)
    except OSError:
        pass
