"""The `cpu` tier: blobs in host memory, LRU within a byte capacity, optional TTL.

Where its blobs live is `memory` (`StoreConfig.cpu_memory`, `--cpu-memory`; docs/design.md §3):
- "plain": Python/numpy buffers. A `bytes` blob (or a read-only memoryview,
  `kvstore.tiers.base.immutable`) is kept as the very object that was put and `get` hands that object
  back; other buffers are copied once on put.
- "pinned": page-locked host memory, so a GPU tier or engine in THIS process copies them to the device
  asynchronously; `get` returns a read-only memoryview of the pinned buffer. Needs CUDA
  (`torch.empty(..., pin_memory=True)` raises without it): a ConfigError otherwise.
- "arena": one shared-memory `Arena` that clients on the same host map read-only (kvstore.tiers.arena);
  `get` returns a read-only memoryview of the blob's region there, and `arena_index` tells those
  clients where each blob lies (kvstore.tiers.arena_index) so they can read it without a request.
  Eviction stays LRU by bytes exactly: a blob for which no free region is large enough
  (fragmentation, regions lent to clients) is kept outside the arena.
- "auto": pinned with CUDA, else plain (a store inside an engine's process); a kvstore-server with
  shared memory on makes it "arena" whether or not the host has CUDA (kvstore.server.runner.server_cpu_memory):
  pinned pages of the server's process serve no other process's GPU copies, the arena serves every
  same-host client.

Byte accounting counts blob bytes exactly (`usage() == sum(len(blob))`), not Python object overhead.
"""

from __future__ import annotations

import logging
import threading
import weakref

import numpy as np
import torch

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.lru import Entry, LRUIndex, check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.arena import Arena
from kvstore.tiers.arena_index import ArenaIndex, PublishedLRU
from kvstore.tiers.base import TierStats, immutable
from kvstore.tiers.indexed import IndexedTier

logger = logging.getLogger(__name__)


def _pinned_copy(blob: Blob) -> memoryview:
    buf = torch.empty(len(blob), dtype=torch.uint8, pin_memory=True)
    arr = buf.numpy()
    arr[:] = memoryview(blob).cast("B")
    return memoryview(arr).toreadonly()  # the view keeps the pinned tensor alive


def resolve_memory(memory: str, cuda: bool) -> str:
    """What `memory` means on a host with or without `cuda`: "auto" is "pinned" with CUDA, else "plain"
    (a kvstore-server with shared memory asks for "arena" instead: kvstore.server.runner.server_cpu_memory); "pinned"
    without CUDA is a ConfigError (asked for, it is not quietly something else); "arena" is an arena
    with or without CUDA."""
    if memory == "auto":
        return "pinned" if cuda else "plain"
    if memory == "pinned" and not cuda:
        raise ConfigError("--cpu-memory pinned needs CUDA, and this host has none: use arena or plain")
    if memory not in ("plain", "pinned", "arena"):
        raise ConfigError(f"cpu_memory must be auto, plain, pinned or arena, got {memory!r}")
    return memory


class CpuTier(IndexedTier):
    """Host-memory tier. Thread-safe; every index operation holds one lock, copies happen outside it."""

    trusted = True  # it keeps verified blobs, immutable, in this process's memory (Tier: `trusted`)

    def __init__(self, capacity: int, name: str = "cpu", memory: str = "auto", clock: Clock = SYSTEM) -> None:
        """`memory`: kvstore.tier_settings.CpuMemory (auto, plain, pinned, arena); `clock`: the store's
        (TTLs are on its `monotonic`)."""
        if capacity <= 0:
            raise InvalidArgument(f"cpu tier capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.memory = resolve_memory(memory, cuda=torch.cuda.is_available())
        self.pinned = self.memory == "pinned"
        self.arena = Arena(capacity) if self.memory == "arena" else None
        # where each arena blob lies, for same-host clients that read without asking (arena_index)
        self.arena_index = ArenaIndex(capacity) if self.arena is not None else None
        self.stats = TierStats()
        self._index: LRUIndex[Blob] = self._new_index()
        self._lock = threading.Lock()
        self._clock = clock.monotonic
        self._ttl_seen = False  # sweep expired blobs on put only once some blob has a TTL

    def _new_index(self) -> LRUIndex[Blob]:
        if self.arena is None or self.arena_index is None:
            return LRUIndex(self.capacity)
        return PublishedLRU(self.capacity, self.arena, self.arena_index)

    def _own(self, blob: Blob) -> Blob:
        """An immutable buffer holding `blob` that the tier may keep."""
        if self.pinned:
            return _pinned_copy(blob)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"a blob is bytes-like, got {type(blob).__name__}")
        return immutable(blob)

    def get(self, key: str) -> Blob | None:
        now = self._clock()
        with self._lock:
            entry = self._index.peek(key)
            if entry is None:
                return None
            if entry.expired(now):
                self._index.pop(key)
                self.stats.expired += 1
                return None
            self._index.touch(key)
            return entry.value

    def _into_arena(self, key: str, blob: Blob, size: int) -> tuple[Blob, list[str]]:
        """`blob` in the arena, after LRU evictions by bytes exactly as without one; when no free region
        is large enough anyway (fragmentation, regions lent to clients) it is kept outside the arena
        instead, never a blob evicted out of LRU order (`stats.extra["spilled_bytes"]`)."""
        assert self.arena is not None
        with self._lock:  # make room first: the regions of the evicted blobs are what the new one gets
            evicted = self._index.make_room_for(key, size)  # a blob it replaces stays readable
            self.stats.evictions += len(evicted)
        keys = [k for k, _ in evicted]
        del evicted  # their regions are free now, unless a client holds one of the blobs
        if self.arena.offset_of(blob) is not None:
            return blob, keys  # the server received it there already
        value = self.arena.store(blob)
        if value is None:
            value = self._spill(blob, size)
        return value, keys

    def _spill(self, blob: Blob, size: int) -> memoryview:
        spilled = np.frombuffer(memoryview(blob).cast("B"), np.uint8).copy()
        self.stats.extra["spilled_bytes"] = self.stats.extra.get("spilled_bytes", 0) + size
        done = weakref.finalize(spilled, self._unspill, size)
        done.atexit = False
        return memoryview(spilled).toreadonly()

    def _unspill(self, size: int) -> None:
        self.stats.extra["spilled_bytes"] -= size

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        check_ttl(ttl_s)
        size = memoryview(blob).nbytes
        if size > self.capacity:
            raise self._too_large(key, size)
        evicted_keys: list[str] = []
        if self.arena is None:
            value = self._own(blob)
        else:
            value, evicted_keys = self._into_arena(key, blob, size)
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        with self._lock:
            self._ttl_seen = self._ttl_seen or expires_at is not None
            expired = self._index.pop_expired(self._clock()) if self._ttl_seen else []
            _, evicted = self._index.insert(key, Entry(size, value, expires_at))
            self.stats.expired += len(expired)
            self.stats.evictions += len(evicted)
        return evicted_keys + [k for k, _ in evicted]

    def close(self) -> None:
        with self._lock:
            if self.arena_index is not None:
                self.arena_index.clear()
            self._index = LRUIndex(self.capacity)
        if self.arena is not None:
            self.arena.close()
        if self.arena_index is not None:
            self.arena_index.close()
