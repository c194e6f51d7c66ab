"""The fs tier's sweep: what is in the shared directory, and what a sweep removes (docs/design.md §4).

Every server sweeps the directory it shares, on its own, every `sweep_interval` seconds; two sweeping
at once is fine. A sweep lists the directory (names and `stat`, no file is opened) and removes:

- temp files older than TMP_MAX_AGE_S (a writer killed mid-write) and files left moved aside by an
  evictor that died between its rename and its unlink;
- tombstones older than TOMBSTONE_S;
- blobs unused (their mtime: a put, or a read at most TOUCH_S ago) for longer than `max_age`;
- while the blobs' bytes are over `capacity`: the least recently used, except those used within
  GRACE_S (just written or read: never a sweep's victim, whatever another server counted).

Each one is removed by identity (`files.remove_if`): a file another server replaced or touched since
the listing is put back, never lost. Two sweeps that both pick a victim remove it once; the second
finds it gone and counts it freed all the same, so they do not evict twice over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiers.fs import files

GRACE_S = 5.0  # a blob used this recently is never a sweep's victim
TOUCH_S = 1.0  # a read moves a blob's mtime when it is older than this (one metadata write a second)


@dataclass(frozen=True)
class Found:
    """One blob or tombstone as the listing saw it."""

    key: str
    ident: files.FileId
    tombstone: bool

    @property
    def mtime(self) -> float:
        return self.ident.mtime_ns / 1e9

    @property
    def size(self) -> int:  # the blob's bytes (the file less its header)
        return max(0, self.ident.size - files.header_size(self.key))


@dataclass
class Listing:
    found: dict[str, Found] = field(default_factory=dict)
    leftovers: list[tuple[Path, float]] = field(default_factory=list)  # temp and aside files, ctime
    errors: int = 0


def list_directory(root: Path) -> Listing:
    """Every blob, tombstone and leftover under `root` (a file whose name is not a key's is left
    alone); raises OSError when `root` itself cannot be listed."""
    out = Listing()
    with os.scandir(root) as shards:
        dirs = [e.path for e in shards if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    for d in dirs:
        try:
            with os.scandir(d) as entries:
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone meanwhile
                    if e.name.startswith((files.TMP, files.GONE)):  # ctime: when it was made or moved
                        out.leftovers.append((Path(e.path), st.st_ctime))
                        continue
                    key = files.parse_name(e.name)
                    if key is None or not e.is_file(follow_symlinks=False) or key[:2] != os.path.basename(d):
                        continue
                    tomb = st.st_size == files.header_size(key)
                    out.found[key] = Found(key, files.FileId.of(st), tomb)
        except OSError:
            out.errors += 1
    return out


def victims(listing: Listing, now: float, capacity: int, max_age: float | None) -> list[Found]:
    """What a sweep at `now` removes, in order (see the module docstring)."""
    out = [f for f in listing.found.values() if f.tombstone and now - f.mtime > files.TOMBSTONE_S]
    blobs = sorted((f for f in listing.found.values() if not f.tombstone), key=lambda f: f.ident.mtime_ns)
    if max_age is not None:
        old = [f for f in blobs if now - f.mtime > max_age]
        out += old
        blobs = blobs[len(old) :]
    total = sum(f.size for f in blobs)
    for f in blobs:
        if total <= capacity or now - f.mtime < GRACE_S:
            break
        out.append(f)
        total -= f.size
    return out


def stale_leftovers(listing: Listing, now: float) -> list[Path]:
    """Temp files of writers long gone, and files moved aside too long ago to be put back."""
    out = []
    for path, ctime in listing.leftovers:
        limit = files.TMP_MAX_AGE_S if path.name.startswith(files.TMP) else 2 * files.RESTORE_S
        if now - ctime > limit:
            out.append(path)
    return out
