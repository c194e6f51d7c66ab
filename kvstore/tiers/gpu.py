"""The gpu tier: blobs in CUDA device memory (one uint8 tensor each), LRU within a byte capacity.

- Copies go through two pinned host staging buffers on a side stream, double-buffered: while the DMA
  engine moves chunk i, the CPU fills (or drains) chunk i+1. A put returns once its blob is on the
  device; a get returns a read-only host buffer once the copy has landed. `get_tensor` hands the
  device tensor itself to on-device consumers (no copy; never mutate it) and `put_tensor` stores one
  without leaving the device.
- Device memory comes from torch's caching allocator; `capacity` bounds the blob bytes we hold.
  Running out of device memory anyway drops the put and counts it, like any backend failure.
- Without CUDA, asking for this tier is a startup `ConfigError` that names the flag. torch does all
  device work: cupy (the optional `gpu` extra) is never imported here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.lru import Entry, LRUIndex, check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.base import BACKEND_ERROR, NO_SPACE, TierStats, TierWriteError
from kvstore.tiers.indexed import IndexedTier

log = logging.getLogger(__name__)

STAGING_BYTES = 8 * 2**20


def require_cuda() -> None:
    """Raise the ConfigError a user sees when they ask for the gpu tier on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "the gpu tier needs CUDA, but torch sees no CUDA device here "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Drop gpu from the tiers: "
            "`--tiers cpu,disk` on the command line, `tiers: [cpu, disk]` in the config file, "
            "or KVSTORE_TIERS=cpu,disk"
        )


class GpuTier(IndexedTier):
    """Device-memory tier. Thread-safe: one lock for the index, one for the staging buffers."""

    name = "gpu"
    trusted = True  # device memory of this process, filled with verified blobs (Tier: `trusted`)

    def __init__(
        self,
        capacity: int,
        device: int | str | torch.device | None = None,
        staging_bytes: int = STAGING_BYTES,
        clock: Clock = SYSTEM,
    ) -> None:
        require_cuda()
        if capacity <= 0:
            raise InvalidArgument(f"gpu tier capacity must be positive, got {capacity}")
        if staging_bytes <= 0:
            raise InvalidArgument(f"staging_bytes must be positive, got {staging_bytes}")
        self.device = torch.device("cuda") if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"the gpu tier lives on a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capacity = capacity
        self.stats = TierStats()
        free, total = torch.cuda.mem_get_info(self.device)
        if capacity > free:
            log.warning(
                "gpu tier capacity %d B exceeds free device memory %d B (of %d B)", capacity, free, total
            )
        self._index: LRUIndex[torch.Tensor] = LRUIndex(capacity)
        self._lock = threading.Lock()
        self._reserved = 0  # bytes of puts whose copy is in flight
        self._copy_lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device)
        self._staging = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._staging_np = [t.numpy() for t in self._staging]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._clock = clock.monotonic

    # ---- copies ---------------------------------------------------------------------------------

    def _to_device(self, src: np.ndarray) -> torch.Tensor:
        n, step = src.size, self._staging[0].numel()
        with torch.cuda.stream(self._stream):
            dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        with self._copy_lock:
            for i, off in enumerate(range(0, n, step)):
                b, c = i % 2, min(step, n - off)
                self._events[b].synchronize()  # the DMA that last read this buffer is done
                self._staging_np[b][:c] = src[off : off + c]
                with torch.cuda.stream(self._stream):
                    dev[off : off + c].copy_(self._staging[b][:c], non_blocking=True)
                    self._events[b].record(self._stream)
            self._stream.synchronize()
        return dev

    def _to_host(self, dev: torch.Tensor) -> memoryview:
        n, step = dev.numel(), self._staging[0].numel()
        out = np.empty(n, dtype=np.uint8)
        chunks = [(off, min(step, n - off)) for off in range(0, n, step)]
        with self._copy_lock:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

            def issue(i: int) -> None:
                off, c = chunks[i]
                with torch.cuda.stream(self._stream):
                    self._staging[i % 2][:c].copy_(dev[off : off + c], non_blocking=True)
                    self._events[i % 2].record(self._stream)

            if chunks:
                issue(0)
            for i, (off, c) in enumerate(chunks):
                if i + 1 < len(chunks):
                    issue(i + 1)  # the DMA fills the other buffer while we drain this one
                self._events[i % 2].synchronize()
                out[off : off + c] = self._staging_np[i % 2][:c]
        return memoryview(out).toreadonly()

    # ---- the Tier protocol ------------------------------------------------------------------------

    def _live(self, key: str) -> Entry[torch.Tensor] | None:
        """The entry, now most recently used; None (and dropped) when missing or expired."""
        with self._lock:
            entry = self._index.peek(key)
            if entry is None:
                return None
            if entry.expired(self._clock()):
                self._index.pop(key)
                self.stats.expired += 1
                return None
            self._index.touch(key)
            return entry

    def get(self, key: str) -> Blob | None:
        entry = self._live(key)
        if entry is None:
            return None
        try:
            return self._to_host(entry.value)
        except RuntimeError as e:  # a CUDA error: a miss, counted
            self.stats.errors += 1
            log.warning("gpu tier: copy of %s to host failed: %s", key, e)
            return None

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """The blob as a uint8 tensor on the device, for consumers on the current stream. Read-only."""
        entry = self._live(key)
        if entry is None:
            return None
        entry.value.record_stream(torch.cuda.current_stream(self.device))  # no reuse while they read it
        return entry.value

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        src = np.frombuffer(_bytes_view(blob), dtype=np.uint8)
        return self._insert(key, src.size, ttl_s, lambda: self._to_device(src))

    def put_tensor(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> list[str]:
        """Store a 1-D uint8 CUDA tensor (copied on the side stream, never through the host)."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.device.type != "cuda":
            raise InvalidArgument(
                f"put_tensor takes a 1-D uint8 CUDA tensor, got {tensor.dtype} {tensor.device}"
            )

        def copy() -> torch.Tensor:
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                dev = torch.empty(tensor.numel(), dtype=torch.uint8, device=self.device)
                dev.copy_(tensor, non_blocking=True)
            self._stream.synchronize()
            return dev

        return self._insert(key, tensor.numel(), ttl_s, copy)

    def _insert(
        self, key: str, size: int, ttl_s: float | None, copy: Callable[[], torch.Tensor]
    ) -> list[str]:
        check_ttl(ttl_s)
        if size > self.capacity:
            raise self._too_large(key, size)
        with self._lock:  # room first (for the copies in flight too), so the allocation below fits
            expired = self._index.pop_expired(self._clock())
            evicted = self._index.make_room_for(key, size + self._reserved)  # the old blob stays readable
            self._reserved += size
            self.stats.expired += len(expired)
            self.stats.evictions += len(evicted)
        del expired
        try:
            dev = copy()
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError and other CUDA errors
            with self._lock:
                self._index.pop(key)  # never serve an older blob of a key whose put failed
            self.stats.errors += 1
            self.stats.dropped_puts += 1
            log.warning("gpu tier: put of %s (%d B) dropped: %s", key, size, e)
            reason = NO_SPACE if isinstance(e, torch.cuda.OutOfMemoryError) else BACKEND_ERROR
            detail = f"{type(e).__name__}: {str(e)[:200]}"
            raise TierWriteError(self.name, {key: reason}, detail, evicted=[k for k, _ in evicted]) from None
        finally:
            with self._lock:
                self._reserved -= size
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        with self._lock:
            _, more = self._index.insert(key, Entry(size, dev, expires_at))
            self.stats.evictions += len(more)
        return [k for k, _ in evicted + more]

    def close(self) -> None:
        with self._lock:
            self._index = LRUIndex(self.capacity)
        torch.cuda.empty_cache()


def _bytes_view(blob: Blob) -> memoryview:
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv
