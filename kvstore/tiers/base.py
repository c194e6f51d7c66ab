"""The tier protocol (docs/design.md §4). A tier stores opaque blobs and never parses them."""

from __future__ import annotations

import errno as _errno
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvstore.protocol import Blob

# Why a tier did not store a blob: the `reason` label of kvstore_dropped_writes_total. The store adds
# QUEUE_FULL (write-back overflow) and TIER_ERROR (an exception a tier should not have raised).
NO_SPACE, NO_FDS, IO_ERROR, UNAVAILABLE, BACKEND_ERROR, TOO_LARGE, QUEUE_FULL, TIER_ERROR = (
    "no_space", "no_fds", "io_error", "unavailable", "backend_error", "too_large", "queue_full",
    "tier_error",
)  # fmt: skip
DROP_REASONS = (NO_SPACE, NO_FDS, IO_ERROR, UNAVAILABLE, BACKEND_ERROR, TOO_LARGE, QUEUE_FULL, TIER_ERROR)


def os_reason(e: OSError) -> str:
    """The drop reason of an OSError."""
    if e.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return NO_SPACE
    if e.errno in (_errno.EMFILE, _errno.ENFILE):
        return NO_FDS
    return IO_ERROR


def os_detail(e: OSError) -> str:
    """`[Errno 28] No space left on device` -> `ENOSPC: No space left on device`."""
    name = _errno.errorcode.get(e.errno or 0, f"errno {e.errno}")
    return f"{name}: {e.strerror or e}"


class TierReadError(Exception):
    """Reading blobs a tier holds failed (disk: EMFILE, EIO): not a miss. `blobs` has what was read,
    None at the keys in `failed` (and at plain misses)."""

    def __init__(self, tier: str, failed: Collection[str], detail: str, blobs: list[Blob | None]) -> None:
        super().__init__(f"{tier}: {detail}")
        self.tier, self.failed, self.detail, self.blobs = tier, frozenset(failed), detail, blobs


class TierWriteError(Exception):
    """A put or delete that a tier could not carry out for some keys.

    `failed`: key -> reason (one of the constants above) for every blob the tier did not store;
    `detail`: what went wrong, naming the errno (for the client's error message and the log);
    `stale`: keys for which the tier may still serve an OLDER blob, because it could neither replace
    nor delete it nor remember to (the store then fails the request: no ack may hide that);
    `evicted`: keys the tier evicted on the way anyway (the put_many return value)."""

    def __init__(
        self,
        tier: str,
        failed: dict[str, str],
        detail: str,
        stale: Collection[str] = (),
        evicted: Iterable[str] = (),
    ) -> None:
        super().__init__(f"{tier}: {detail}")
        self.tier, self.failed, self.detail = tier, failed, detail
        self.stale, self.evicted = frozenset(stale), list(evicted)


def immutable(blob: Blob) -> bytes | memoryview:
    """`blob` as a buffer that may be kept: a `bytes`, or a read-only flat byte memoryview, as it is
    (handing one over promises that nothing writes its memory any more: the server receives request
    bodies into such buffers, so a put is never copied between the socket and the tier); anything
    else is copied into bytes."""
    if isinstance(blob, bytes):
        return blob
    if (
        isinstance(blob, memoryview)
        and blob.readonly
        and blob.c_contiguous
        and blob.ndim == 1
        and blob.itemsize == 1
    ):
        return blob
    return bytes(blob)


@dataclass
class TierStats:
    """Counters a tier keeps about itself; the store turns them into metrics."""

    evictions: int = 0
    expired: int = 0
    errors: int = 0  # backend failures (I/O errors, a lost Redis connection...)
    dropped_puts: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tier(Protocol):
    """A byte-capacity-bounded key -> blob map with LRU eviction. Thread-safe.

    - `put` stores the blob (replacing any old one), evicting least-recently-used blobs to fit, and
      returns the keys it evicted; or it raises TierWriteError naming what it did not store and why
      (a blob larger than the capacity: TOO_LARGE; disk full: NO_SPACE...). `put_many` stores what it
      can and raises for the rest. Never an ack for a blob that was not stored.
    - After a put or delete returns or raises, the tier never serves an older blob of that key: it
      replaced it, deleted it, or (a backend it cannot reach) remembers the key as invalidated until
      it can delete it; where it can do none of these it raises with the key in `stale`.
    - `get` returns the blob (bytes-like, never to be mutated by the caller) or None, and marks it
      most recently used. An expired blob is a miss and is removed.
    - `ttl_s`: seconds to live, None for no expiry.
    - Backend failures never raise out of get/contains: a get is a miss, counted in `stats.errors`;
      a read error of a blob the tier holds (disk: EMFILE, EIO) raises OSError instead, so that the
      store answers an error, not a miss that hides one.
    - Optional: `contains_many(keys) -> list[bool]`. A remote tier should offer it: the store then
      answers `batch_exists` / `lookup_prefix` with one round trip instead of one per key.
    - Optional: `trusted = True`. The tier holds only buffers the store verified before it put them,
      in memory no other process can write (cpu, gpu): the store's reads skip their checksum. The
      checksum still protects every boundary a blob crosses: a put's on receipt, a reader's on use,
      and each read from a tier outside this process (disk, Redis).
    """

    name: str
    capacity: int
    stats: TierStats

    def get(self, key: str) -> Blob | None: ...

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> Iterator[str]: ...

    def usage(self) -> int:
        """Bytes held (blob bytes, exactly)."""
        ...

    def __len__(self) -> int: ...

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]: ...

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]: ...

    def close(self) -> None: ...
