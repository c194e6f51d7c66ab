"""The worker side of the kvstore connector: moves KV between the paged cache and the store.

Loads: the step's chunks are fetched, verified, decoded and scattered into their blocks by a small
thread pool (each thread decodes into its own reusable chunk buffer, and chunks own disjoint blocks,
so threads never write the same memory). The first chunk that is missing, corrupt, mismatched or
unreachable ends the load of its request: every block from there on is reported by
`get_block_ids_with_load_errors`, and the engine recomputes from it. A blob holds every layer of its
chunk, so no layer is ready before its whole chunk is: the load completes in `start_load_kv` and
`wait_for_layer_load` has nothing left to wait for (loads with `load_async` finish in the background
and are reported by `get_finished` instead).

Saves: `save_kv_layer` only checks its arguments (a chunk needs every layer); `wait_for_save` copies
the step's chunks out of the cache and hands them to a background thread (`kvstore.connectors.kv_saver`).
So `get_finished` reports a finished request as soon as its blocks were copied out; only a prefill
instance (kv_producer), whose answer says "the KV is stored", waits until none of its saves is in
flight.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace

import torch
from kvstore.connectors.chunks import CacheGeometry
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_saver import ChunkSaver
from kvstore.connectors.layouts import ENGINE_LAYOUT, PagedLayout
from kvstore.connectors.meta import LoadSpec, SaveSpec, StepTransfers
from kvstore.connectors.metrics import MISS_REASONS
from kvstore.connectors.shard import Shard, carve, gather_to_first
from kvstore.connectors.store_handle import StoreHandle, is_unreachable

from kvstore.blob import COMPRESSION_NONE, FP8_DTYPES, BlobHeader, decode_blob, encode_blob, verify_blob
from kvstore.codecs import get_codec
from kvstore.codecs.raw import RawCodec
from kvstore.errors import CorruptBlob, InvalidArgument, KVStoreError
from kvstore.keys import stage_key

logger = logging.getLogger(__name__)
# torch warns that a tensor over an immutable bytes object could be written; raw_view's never is
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def raw_view(blob: bytes | bytearray | memoryview, header: BlobHeader) -> torch.Tensor:
    """The KV of a verified raw, uncompressed blob as a read-only tensor over the blob's own bytes."""
    payload = memoryview(blob).cast("B")[header.payload_offset : header.payload_offset + header.payload_len]
    return torch.frombuffer(payload, dtype=torch.uint8).view(header.dtype).view(header.shape)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def populate(tensors: Sequence[torch.Tensor]) -> None:
    """Map every page of CPU KV caches now (`MADV_POPULATE_WRITE`: pages made present, nothing written),
    so that the first loads into a fresh engine's cache do not take a page fault per 4 KiB (~50 ms
    for a 4k-token SmolLM2 prompt): once, at registration. Best effort: a kernel without it, or another
    OS, leaves the pages to fault as before."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    page = mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor only
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start and madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            logger.debug("MADV_POPULATE_WRITE: errno %d (pages fault on first use)", ctypes.get_errno())
            return


class _ChunkLoadError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KVStoreWorker:
    def __init__(
        self,
        config: KVTransferConfig,
        handle: StoreHandle,
        paged: PagedLayout = ENGINE_LAYOUT,
        shard: Shard | None = None,
    ) -> None:
        assert config.layout is not None, "KVTransferConfig.for_engine(...) sets the layout"
        get_codec(config.codec)  # unknown or unregistered codec: CodecError now, not at the first save
        self.config = config
        self.handle = handle
        self.paged = paged  # how the engine's paged cache holds KV (connectors.layouts)
        # which part of a stored chunk this worker's cache holds (TP heads, PP layers: connectors.shard)
        self.shard = shard or Shard(num_heads=config.layout.num_kv_heads)
        self._heads = self.shard.heads
        self.metrics = handle.metrics
        self.kv_caches: list[torch.Tensor] = []
        self.geometry: CacheGeometry | None = None  # this worker's cache
        self.stored: CacheGeometry | None = None  # what its chunks are stored as (every head)
        self.codec = config.codec  # what saves use (register_kv_caches: raw for an fp8 cache)
        self._load_pool = ThreadPoolExecutor(config.load_threads, thread_name_prefix="kv-load")
        self._async_loads = ThreadPoolExecutor(1, thread_name_prefix="kv-load-async")
        self._buffers = threading.local()
        self._lock = threading.Lock()
        self._finishing: set[str] = set()
        self._finished_loads: set[str] = set()
        self._loads_done = threading.Condition(self._lock)
        self._hold_until_stored = config.is_producer
        self._load_errors: set[int] = set()
        # requests whose load failed, when failures are per request (vLLM's hybrid manager: block ids are
        # per group, so it cannot take failed blocks; the request is recomputed whole instead)
        self.fail_whole_requests = False
        self._failed_loads: set[str] = set()
        self.saver = ChunkSaver(config, handle, paged)

    # ---- setup --------------------------------------------------------------------------------
    def set_paged(self, paged: PagedLayout) -> None:
        """Another paged layout (before register_kv_caches): vLLM's hybrid manager's groups."""
        self.paged = self.saver.paged = paged

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        geo = self.paged.geometry(kv_caches)
        lay, shard = self.config.layout, self.shard
        layers = shard.layers[1] - shard.layers[0] if shard.layers else lay.num_layers
        want = (
            layers,
            shard.local_heads or lay.num_kv_heads,
            lay.head_dim,
            lay.kv_dtype,
            self.config.block_size,
        )
        dtype = str(geo.dtype).removeprefix("torch.")
        if dtype == "uint8" and lay.kv_dtype.startswith("float8"):
            dtype = lay.kv_dtype  # vLLM hands an fp8 cache over as uint8
        have = (geo.num_layers, geo.num_kv_heads, geo.head_dim, dtype, geo.block_size)
        if want != have:
            raise InvalidArgument(
                f"KV caches (layers, kv_heads, head_dim, dtype, block_size)={have} != config {want}"
            )
        stored = replace(geo, num_kv_heads=lay.num_kv_heads, dtype=getattr(torch, lay.kv_dtype))
        # An fp8 KV cache is already quantised: its blocks are stored as they are, never quantised again.
        self.codec = "raw" if stored.dtype in FP8_DTYPES or stored.planes == 1 else self.config.codec
        self.saver.codec = self.codec
        # vLLM hands over an fp8 cache as uint8: its bytes are stored as the fp8 format the layout names
        self.saver.blob_dtype = stored.dtype if geo.dtype != stored.dtype else None
        if self.codec != self.config.codec:
            what = "fp8" if stored.dtype in FP8_DTYPES else "MLA latent"
            logger.info("%s KV cache: chunks are stored raw, not with codec %s", what, self.config.codec)
        if self.config.saves and shard.stores:  # a codec that cannot encode this layout fails now
            encode_blob(
                torch.zeros(stored.chunk_shape(self.config.chunk_size), dtype=stored.dtype), self.codec
            )
        self.kv_caches = list(kv_caches)
        populate(self.kv_caches)
        self.geometry, self.stored = geo, stored

    def handle_preemptions(self, step: StepTransfers) -> None:
        if step.preempt_saves:
            assert self.geometry is not None, "register_kv_caches() first"
            self._copy_out(step.preempt_saves)

    # ---- loads --------------------------------------------------------------------------------
    def start_load_kv(self, step: StepTransfers) -> None:
        if not step.loads:
            return
        assert self.geometry is not None, "register_kv_caches() first"
        loads = [self._staged_load(spec) for spec in step.loads]
        if self.config.load_async:
            for spec in loads:
                self._async_loads.submit(self._load_async, spec)
            return
        t0 = time.perf_counter()
        for spec in loads:
            self._load(spec)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)

    def _load_async(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        try:
            self._load(spec)
        except Exception:  # a dead load thread would leave its request waiting forever
            logger.exception("loading %s failed", spec.request_id)
            self._fail(spec, spec.first_chunk, "corrupt")
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        with self._lock:  # after _fail: get_finished never reports a load before its errors
            self._finished_loads.add(spec.request_id)
            self._loads_done.notify_all()

    def wait_for_finished(self, timeout: float) -> None:
        with self._lock:
            if not self._finished_loads:
                self._loads_done.wait(timeout)

    def _load(self, spec: LoadSpec) -> None:
        """Load every chunk of `spec`; on the first failure, report its blocks and all later ones."""
        bs, cs = self.config.block_size, self.config.chunk_size
        if not self.handle.reachable():
            return self._fail(spec, spec.first_chunk, "unreachable")
        try:
            reasons: list[str | None] = []
            lease = self.handle.lease_blobs(spec.keys, reasons)
        except KVStoreError as e:
            if is_unreachable(e):
                self.handle.mark_unreachable(e)
            return self._fail(spec, spec.first_chunk, "unreachable" if is_unreachable(e) else "corrupt")
        futures = []
        sizes = spec.chunk_tokens or (cs,) * len(spec.keys)
        try:
            for i, (c, blob, size) in enumerate(zip(spec.chunk_indices(), lease.blobs, sizes, strict=True)):
                lo, hi = max(spec.start_token, c * cs), min(spec.end_token, (c + 1) * cs)
                assert hi - c * cs <= size, f"chunk {c} holds {size} tokens, the load needs {hi - c * cs}"
                blocks = spec.block_ids[lo // bs : hi // bs]
                why = reasons[i] if reasons else None
                if why in (None, "not_stored"):  # the lookup found it, the load did not: it was there
                    why = "evicted"
                fut = self._load_pool.submit(
                    self._load_chunk,
                    spec.keys[i],
                    blob,
                    lease.headers[i],
                    blocks,
                    (lo - c * cs) // bs,
                    size,
                    why,
                )
                futures.append((c, fut))
        finally:  # the lent blobs stay valid until every chunk is scattered
            wait([f for _, f in futures])
            intact = lease.intact()  # in place: whether the server overwrote one while it was scattered
            lease.release()
        failed_at: tuple[int, str] | None = None
        for (c, fut), whole in zip(futures, intact, strict=True):
            try:
                nbytes, ntokens = fut.result()
                if not whole:  # what was scattered may be torn: those blocks are recomputed
                    raise _ChunkLoadError("evicted")
            except _ChunkLoadError as e:
                failed_at = failed_at or (c, e.reason)
                continue
            self.metrics.load_bytes.inc(nbytes)
            self.metrics.loaded_tokens.inc(ntokens)
        if failed_at is not None:
            self._fail(spec, *failed_at)

    def _load_chunk(
        self,
        key: str,
        blob: object,
        header: BlobHeader | None,
        block_ids: Sequence[int],
        first_block: int,
        num_tokens: int,
        miss_reason: str,
    ) -> tuple[int, int]:
        if blob is None:
            raise _ChunkLoadError(miss_reason if miss_reason in MISS_REASONS else "evicted")
        geo = self.stored
        shape = geo.chunk_shape(num_tokens)
        try:
            # verified (for this key) already when the store is in this process
            header = header or verify_blob(blob, key=key)
            header.check_key(key)
            if header.shape != shape or header.dtype != geo.dtype:
                raise CorruptBlob(
                    f"chunk holds {header.shape} {header.dtype}, this engine needs {shape} {geo.dtype}"
                )
            if header.codec_id == RawCodec.codec_id and header.compression == COMPRESSION_NONE:
                kv = raw_view(blob, header)  # scatter straight from the verified blob: no copy
            elif num_tokens == self.config.chunk_size:
                buf = getattr(self._buffers, "chunk", None)
                if buf is None:
                    buf = self._buffers.chunk = torch.empty(shape, dtype=geo.dtype)
                kv = decode_blob(blob, out=buf, header=header)
            else:  # a partial chunk: rare enough for a fresh buffer
                kv = decode_blob(blob, header=header)
        except (CorruptBlob, InvalidArgument) as e:
            logger.warning("corrupt or mismatched chunk from the store: %s", e)
            raise _ChunkLoadError("corrupt") from None
        if self._heads is not None:  # this rank's heads only: a view, the others are never read
            kv = kv[:, :, :, self._heads[0] : self._heads[1]]
        if kv.dtype != self.geometry.dtype:  # fp8 bytes into vLLM's uint8 cache
            kv = kv.view(self.geometry.dtype)
        self.paged.scatter(self.kv_caches, kv, block_ids, first_block)
        return len(blob), len(block_ids) * self.config.block_size

    def _fail(self, spec: LoadSpec, chunk: int, reason: str) -> None:
        bs, cs = self.config.block_size, self.config.chunk_size
        start = max(spec.start_token, chunk * cs)
        bad = spec.block_ids[start // bs : spec.end_token // bs]
        chunks_lost = spec.first_chunk + len(spec.keys) - chunk
        self.metrics.miss(reason, chunks_lost)
        self.metrics.load_errors.inc(len(bad))
        if self.fail_whole_requests:
            logger.info(
                "request %s: chunk %d %s; the request will be recomputed", spec.request_id, chunk, reason
            )
            with self._lock:
                self._failed_loads.add(spec.request_id)
            return
        logger.info(
            "request %s: chunk %d %s; %d blocks will be recomputed", spec.request_id, chunk, reason, len(bad)
        )
        with self._lock:
            self._load_errors.update(bad)

    def wait_for_layer_load(self, layer: int) -> None:
        assert 0 <= layer < len(self.kv_caches), layer

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    # ---- saves (connectors.kv_saver) -----------------------------------------------------------
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        assert 0 <= layer < len(self.kv_caches), layer
        assert kv_layer is self.kv_caches[layer] or kv_layer.shape == self.kv_caches[layer].shape

    def wait_for_save(self, step: StepTransfers) -> None:
        if step.saves:
            assert self.geometry is not None, "register_kv_caches() first"
            self._copy_out(step.saves)

    def _stage(self, key: str) -> str:
        assert self.shard.layers is not None
        return stage_key(key, *self.shard.layers)

    def _staged_load(self, spec: LoadSpec) -> LoadSpec:
        """Under PP, this stage's keys of the chunks (its layers only: `kvstore.keys.stage_key`)."""
        return spec if self.shard.layers is None else replace(spec, keys=tuple(map(self._stage, spec.keys)))

    def _staged_save(self, spec: SaveSpec) -> SaveSpec:
        if self.shard.layers is None:
            return spec
        parent = None if spec.parent is None else self._stage(spec.parent)
        return replace(
            spec, key=self._stage(spec.key), replaces=tuple(map(self._stage, spec.replaces)), parent=parent
        )

    def _copy_out(self, saves: Sequence[SaveSpec]) -> None:
        """Copy `saves` out of the cache and queue them; under TP, TP rank 0 stores every chunk: with
        the heads split, every rank's heads are gathered to it first (one collective a step)."""
        shard = self.shard
        saves = [self._staged_save(spec) for spec in saves]
        if not shard.gathers:
            if shard.stores:  # TP=1, or a latent every rank holds alike (stored once)
                self.saver.copy_out(self.kv_caches, saves)
            return
        geo, bs = self.geometry, self.config.block_size
        shapes = [geo.chunk_shape(len(spec.block_ids) * bs) for spec in saves]
        flat = torch.empty(
            sum(math.prod(s) for s in shapes), dtype=geo.dtype, device=self.kv_caches[0].device
        )
        for spec, out in zip(saves, carve(flat, shapes), strict=True):
            self.paged.gather(self.kv_caches, spec.block_ids, out=out)
        parts = gather_to_first(flat, shard)
        if parts is None:
            return
        by_rank = [carve(parts[r], shapes) for r in shard.contributors()]
        self.saver.submit(saves, lambda i, out: torch.cat([p[i] for p in by_rank], dim=3, out=out))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, recved, _ = self.transfer_results(finished_req_ids)
        return sent or None, recved or None

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose saves are done, whose loads are done, those of them whose load failed whole)."""
        with self._lock:
            self._finishing |= finished_req_ids
            # their blocks were copied out in wait_for_save; a prefill instance also waits for the store
            sent = {r for r in self._finishing if not self._hold_until_stored or not self.saver.in_flight(r)}
            self._finishing -= sent
            recved, self._finished_loads = self._finished_loads, set()
            failed = self._failed_loads & recved  # _fail ran before the load was marked done
            self._failed_loads -= failed
        return sent, recved, failed

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every save handed out so far has reached the store (or failed)."""
        self.saver.flush(timeout)

    def shutdown(self) -> None:
        self._async_loads.shutdown(wait=True)
        self.saver.shutdown()
        self._load_pool.shutdown(wait=True)
