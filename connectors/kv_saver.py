"""The save path of the kvstore connector's worker side.

`copy_out` copies each chunk to save (a newly full chunk, or the partial chunk of a finished
request) out of the paged cache — after it returns the engine may free or reuse the blocks — and
hands the copies to a background thread that skips chunks the store already has (one round trip),
encodes the rest with the configured codec and puts them in one batch that also names the shorter
partial chunks they supersede, deleted once the batch is stored (a second round trip; a save with
nothing to put deletes them in one). With a same-host server each blob is laid out straight in its
shared memory (`kvstore.blob.PreparedBlob`: a raw payload goes from the copy-out buffer to the
segment, once). A request's save is "in flight" until that thread is done with it; `flush` waits for all.
The copy-out queue is bounded (`max_pending_saves`): beyond it, and while the store is unreachable,
saves are dropped and counted, never waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.layouts import PagedLayout
from kvstore.connectors.meta import SaveSpec
from kvstore.connectors.store_handle import StoreHandle, is_unreachable

from kvstore.blob import prepare_blob
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


class ChunkSaver:
    def __init__(self, config: KVTransferConfig, handle: StoreHandle, paged: PagedLayout) -> None:
        self.config = config
        self.handle = handle
        self.paged = paged
        self.codec = config.codec  # what saves use (the worker's register_kv_caches: raw for an fp8 cache)
        self.blob_dtype: torch.dtype | None = None  # what the chunks' bytes are, when not their dtype (fp8)
        self.metrics = handle.metrics
        self._pool = ThreadPoolExecutor(config.save_threads, thread_name_prefix="kv-save")
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = defaultdict(int)  # request -> chunks not yet saved
        self._pending = 0
        self._futures: list[Future] = []
        self._spare: list[torch.Tensor] = []  # chunk buffers of finished saves, reused for copy-out

    def in_flight(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._inflight

    def copy_out(self, kv_caches: Sequence[torch.Tensor], saves: Sequence[SaveSpec]) -> None:
        self.submit(saves, lambda i, out: self.paged.gather(kv_caches, saves[i].block_ids, out=out))

    def submit(
        self, saves: Sequence[SaveSpec], fill: Callable[[int, torch.Tensor | None], torch.Tensor]
    ) -> None:
        """Queue `saves`: `fill(i, out)` gives the i-th one's chunk, a copy (into `out`, a reused
        full-chunk buffer, when one is given) that no later step can change."""
        if not self.handle.reachable():  # the store is down: copying the blocks out would be wasted
            self.metrics.dropped_saves.labels("store_error").inc(len(saves))
            return
        t0 = time.perf_counter()
        batch: list[tuple[SaveSpec, torch.Tensor]] = []
        for i, spec in enumerate(saves):
            with self._lock:
                full = self._pending >= self.config.max_pending_saves
                if not full:
                    self._pending += 1
                    self._inflight[spec.request_id] += 1
            if full:
                self.metrics.dropped_saves.labels("queue_full").inc()
                continue
            buf = None
            if not spec.partial:
                with self._lock:
                    buf = self._spare.pop() if self._spare else None
            batch.append((spec, fill(i, buf)))
        self.metrics.copy_out_seconds.observe(time.perf_counter() - t0)
        self.metrics.pending_saves.set(self._pending)
        n = max(1, -(-len(batch) // self.config.save_threads))
        for i in range(0, len(batch), n):
            self._futures.append(self._pool.submit(self._save, batch[i : i + n]))
        self._futures = [f for f in self._futures if not f.done()]

    def _save(self, batch: list[tuple[SaveSpec, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        try:
            if not self.handle.reachable():
                self.metrics.dropped_saves.labels("store_error").inc(len(batch))
                return
            keys = [spec.key for spec, _ in batch]
            replaced = list(dict.fromkeys(k for spec, _ in batch for k in spec.replaces))
            present = self.handle.batch_exists(keys + replaced)  # one round trip for both
            stale = [k for k, have in zip(replaced, present[len(keys) :], strict=True) if have]
            todo = [
                (spec, kv) for (spec, kv), have in zip(batch, present[: len(keys)], strict=True) if not have
            ]
            items = [
                (spec.key, prepare_blob(self._as_stored(kv), codec=self.codec, key=spec.key))
                for spec, kv in todo
            ]
            hints = [_hint(spec, kv) for spec, kv in todo]
            try:
                if items:  # the superseded partials go in the same round trip, once the chunks are stored
                    self.handle.batch_put_blobs(
                        items, stale, [h and h[0] for h in hints], [h and h[1] for h in hints]
                    )
                elif stale:
                    self.handle.batch_delete(stale)
            finally:  # a raw blob reads its buffer until it is written out
                self._recycle([kv for spec, kv in batch if not spec.partial])
            self.metrics.saved_chunks.inc(len(items))
            self.metrics.skipped_saves.inc(len(batch) - len(items))
            self.metrics.save_bytes.inc(sum(b.nbytes for _, b in items))
            self.metrics.partial_chunks.labels("saved").inc(sum(1 for spec, _ in batch if spec.partial))
            self.metrics.partial_chunks.labels("replaced").inc(len(stale))
            self.metrics.save_seconds.observe(time.perf_counter() - t0)
        except KVStoreError as e:
            if is_unreachable(e):
                self.handle.mark_unreachable(e)
            else:
                logger.error("saving %d chunks failed: %r", len(batch), e)
            self.metrics.dropped_saves.labels("store_error").inc(len(batch))
        except Exception:  # a background thread that dies silently would hold requests forever
            logger.exception("saving %d chunks failed", len(batch))
            self.metrics.dropped_saves.labels("store_error").inc(len(batch))
        finally:
            with self._lock:
                for spec, _ in batch:
                    self._inflight[spec.request_id] -= 1
                    if self._inflight[spec.request_id] == 0:
                        del self._inflight[spec.request_id]
                self._pending -= len(batch)
                self.metrics.pending_saves.set(self._pending)

    def _as_stored(self, kv: torch.Tensor) -> torch.Tensor:
        return kv if self.blob_dtype is None else kv.view(self.blob_dtype)

    def _recycle(self, buffers: list[torch.Tensor]) -> None:
        """Their blobs are written out: the buffers can take the next copy-out."""
        with self._lock:
            room = self.config.max_pending_saves - len(self._spare)
            self._spare.extend(buffers[: max(0, room)])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every save handed out so far has reached the store (or failed)."""
        for fut in list(self._futures):
            fut.result(timeout=timeout)
        self._futures = [f for f in self._futures if not f.done()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _hint(spec: SaveSpec, kv: torch.Tensor) -> tuple[tuple[int, ...], str | None] | None:
    """(token ids, parent key): the hints a put of this chunk carries for a server's KV events
    (kvstore.token_hints), when there are as many token ids as the chunk's KV holds tokens."""
    ids = spec.token_ids
    if ids is None or kv.dim() != 5 or kv.shape[2] != len(ids):
        return None
    return ids, spec.parent
