"""The tier protocol (DESIGN.md, Spec 4). A tier stores opaque blobs and never parses them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

Blob = bytes | bytearray | memoryview


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
      returns the keys it evicted. A blob larger than the capacity is not stored (returns [] and the
      key is absent afterwards).
    - `get` returns the blob (bytes-like, never to be mutated by the caller) or None, and marks it
      most recently used. An expired blob is a miss and is removed.
    - `ttl_s`: seconds to live, None for no expiry.
    - Backend failures never raise out of get/put/contains: a get is a miss, a put is dropped and
      counted in `stats.errors` / `stats.dropped_puts`.
    - Optional: `contains_many(keys) -> list[bool]`. A remote tier should offer it: the store then
      answers `batch_exists` / `lookup_prefix` with one round trip instead of one per key.
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
