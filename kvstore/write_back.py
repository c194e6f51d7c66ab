"""Write-back for the tiered store: a bounded queue of blobs bound for the lower tiers, and the one
thread that writes them (Spec 4, `write_policy="back"`).

- `submit` never blocks: when the queue is full the blob is not queued and `on_drop(key)` is called
  (the store counts a dropped write for every lower tier; it deleted the key below before queueing,
  so a dropped write leaves a miss there, never an older blob).
- Only the newest queued write of a key is written: `cancel(key)` (a newer put reached the top tier,
  or the key was deleted) makes every queued write of it stale, and a write of it in progress is
  undone right after it lands (`undo(key)`), so neither a deleted nor a replaced blob stays below.
- `flush(timeout)` waits until the queue is empty and the writer idle; `close(timeout)` drains it
  (within `timeout`: what is left then is not written, and the thread is told to stop).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


class WriteBack:
    """A bounded write-back queue and its writer thread. Thread-safe."""

    def __init__(
        self,
        maxsize: int,
        write: Callable[[str, bytes], None],
        undo: Callable[[str], None],
        on_drop: Callable[[str], None],
    ) -> None:
        """`write(key, blob)` stores into the lower tiers, `undo(key)` deletes from them."""
        assert maxsize >= 1, maxsize
        self._write, self._undo, self._on_drop = write, undo, on_drop
        self._queue: queue.Queue[tuple[str, bytes, int] | None] = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # key -> sequence number of its newest queued write-back
        self._seq = 0
        self._inflight: str | None = None  # the key the writer is writing now
        self._inflight_deleted = False
        self._writer = threading.Thread(target=self._loop, name="kvstore-write-back", daemon=True)
        self._writer.start()

    def submit(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Queue each blob for the lower tiers; a full queue drops it (`on_drop`), never waits."""
        for key, blob in items:
            with self._lock:
                self._seq += 1
                seq = self._seq
                self._pending[key] = seq
            try:
                self._queue.put_nowait((key, blob, seq))
            except queue.Full:
                with self._lock:
                    if self._pending.get(key) == seq:
                        del self._pending[key]
                self._on_drop(key)

    def cancel(self, key: str) -> None:
        """`key` was deleted or replaced: skip its queued write-backs and undo the one being written."""
        with self._lock:
            self._pending.pop(key, None)
            if self._inflight == key:
                self._inflight_deleted = True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, blob, seq = item
                with self._lock:
                    if self._pending.get(key) != seq:  # deleted or overwritten since it was queued
                        continue
                    self._inflight, self._inflight_deleted = key, False
                self._write(key, blob)
                with self._lock:
                    self._inflight = None
                    undo = self._inflight_deleted  # deleted while we wrote: take it back out
                    if self._pending.get(key) == seq:
                        del self._pending[key]
                if undo:
                    self._undo(key)
            finally:
                self._queue.task_done()

    def queued(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` s) until every queued write-back has been written; True if so."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (within `timeout` s), then stop the writer thread. What is still queued
        after `timeout` is not written (the store deleted those keys below when it queued them).
        True if everything was written."""
        flushed = self.flush(timeout)
        if not flushed:
            with self._lock:
                left = len(self._pending)
                self._pending.clear()  # the writer skips what is still queued
            logger.warning("write-back: %d queued writes not flushed within %.1f s: not written below",
                           left, timeout)  # fmt: skip
        try:
            self._queue.put(None, timeout=None if flushed else 1.0)
        except queue.Full:  # the writer is stuck in one write: leave it (a daemon thread)
            return False
        self._writer.join(None if flushed else 1.0)
        return flushed
