"""The file operations of the disk tier, safe against a data directory that others can change.

- Names: `<key>` or `<key>.x<expiry ms>`; `parse_name` accepts exactly these (the one key parser).
- Reads open with O_NOFOLLOW | O_NONBLOCK and check `fstat` is a regular file: a symlink, FIFO or
  device planted under a blob's name is refused at once (a FIFO would block a plain open forever).
- Writes go to a temp file created O_EXCL | O_NOFOLLOW in the shard directory, which is made again
  if it was removed behind our back.
- The directory lock is an flock on the directory itself: deleting a lock *file* cannot let a second
  process in.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.keys import is_key

TMP_PREFIX = ".tmp-"
_EXPIRY_RE = re.compile(r"[0-9]{1,20}")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(Exception):
    """A blob's path holds something other than a regular file (symlink, FIFO, device, directory)."""


def parse_name(name: str) -> tuple[str, int | None] | None:
    """(key, expiry ms or None) of a blob file name `<key>` or `<key>.x<ms>`; None for any other name
    (never a near miss: "<key>\\n" is not `<key>`)."""
    key, sep, expiry = name.partition(".x")
    if not is_key(key) or (sep and _EXPIRY_RE.fullmatch(expiry) is None):
        return None
    return key, int(expiry) if sep else None


def lock_directory(root: Path) -> int:
    """An exclusive flock on `root` itself; the fd holds it until closed. ConfigError if taken."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot use {root} for the disk tier: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"{root} is in use by another process (a kvstore-server, engine or Store.local with the "
            "same disk path): stop it, or give this store its own directory (disk_path=, --disk-path, "
            "KVSTORE_DISK_PATH)"
        ) from None
    return fd


def is_regular(path: Path) -> bool:
    """lstat says a regular file (FileNotFoundError if there is nothing)."""
    return stat.S_ISREG(os.lstat(path).st_mode)


def read_regular(path: Path, touch_ns: int | None) -> bytes:
    """The whole file, never blocking on what is not a regular file (NotRegular); `touch_ns` sets its
    mtime (the disk tier's LRU order: its clock's now). OSError for everything else, FileNotFoundError
    included."""
    fd = os.open(path, _READ_FLAGS)  # ELOOP for a symlink
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        with open(fd, "rb", buffering=0, closefd=False) as f:
            data = f.readall()
        if touch_ns is not None:
            os.utime(fd, ns=(touch_ns, touch_ns))
        return data
    finally:
        os.close(fd)


def write_new(shard: Path, tmp: Path, data: memoryview, fsync: bool, mtime_ns: int | None = None) -> None:
    """Create `tmp` in `shard` (made again if it vanished), write `data` whole, fsync if asked, and set
    its mtime to `mtime_ns` (the disk tier's clock) when given."""
    try:
        fd = os.open(tmp, _CREATE_FLAGS, 0o644)
    except FileNotFoundError:  # the shard directory was removed behind our back
        make_dirs(shard, fsync)
        fd = os.open(tmp, _CREATE_FLAGS, 0o644)
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        if fsync:
            os.fsync(fd)
        if mtime_ns is not None:
            os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def make_dirs(shard: Path, fsync: bool) -> None:
    """`shard` and its parent, the new entries made durable."""
    if shard.is_dir():
        return
    shard.mkdir(parents=True, exist_ok=True)
    if fsync:
        fsync_dir(shard.parent)
        fsync_dir(shard.parent.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
