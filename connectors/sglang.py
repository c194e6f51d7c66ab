"""`KVStoreHiCacheStorage`: kvstore as a storage backend (L3) of SGLang's hierarchical cache (HiCache).

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
          "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "url": "http://127.0.0.1:8100"}'

SGLang's factory builds it as `KVStoreHiCacheStorage(storage_config, kwargs)` and its
`HiCacheController` calls it from its own backup, prefetch and I/O threads: `batch_exists` (the hit
query: how many leading pages are stored), `batch_set_v1` / `batch_get_v1` (with `"interface_v1": 1`:
pages straight out of and into the host pool at `host_indices`), or the generic `batch_set` /
`batch_get` of flat page tensors. Settings are the vLLM connector's (`kvstore.connectors.config
.KVTransferConfig`: `url` or `local`, `token_file`, `codec`, `namespace`, `timeout_s`,
`lookup_timeout_s`, `unreachable_backoff_s`, the local store's tiers) from the extra config over
`KVSTORE_*` variables; `model_path` names the directory (or hub id) of the model's config.json
when SGLang's served model name does not.

- Keys and layout (`kvstore.connectors.sglang_pages`): SGLang's page hashes under the layout
  fingerprint of docs/design.md §1: model name and config hash, layers, KV heads of this rank, head dim,
  dtype, the page size as the chunk size, and the TP rank and size of `HiCacheStorageConfig`; pipeline
  and attention-context ranks in a shard tag. An MLA model's KV is the same on every TP rank: stored
  once (TP rank 0 of 1 in its keys), by the ranks SGLang names writers (`is_storage_writer`).
- Pages are blobs of docs/design.md §2 (`[2, layers, tokens, heads, head_dim]`), whatever the host
  layout: the server's tiers, per-tier codecs, Valkey Cluster and KV events treat them as any chunk.
- Never raises on the data path: a store that is down, hung, refusing or answering garbage is a miss
  (or a backup not done), counted in `stats()` and logged at most every 10 s per kind; after a failure
  the store is skipped for `unreachable_backoff_s` (the connectors' circuit breaker). Each call is
  bounded: a hit query by `lookup_timeout_s`, a load or backup by `timeout_s` (2 s by default here).

The only module besides `kvstore.connectors.sglang_pages` that knows SGLang; nothing imports it but
SGLang (through `module_path`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.sglang_pages import (
    PageGeometry,
    StridedBlob,
    geometry_of,
    load_into,
    page_keys,
    page_layout,
    shard_of,
)
from kvstore.connectors.store_handle import StoreHandle, acquire_store, is_unreachable, release_store
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.blob import prepare_blob
from kvstore.errors import ConfigError, CorruptBlob, KVStoreError
from kvstore.keys import root_key

logger = logging.getLogger(__name__)
# the extra config's keys that are SGLang's (its factory's, its controllers', its file backend's), not ours
SGLANG_KEYS = frozenset(
    {
        "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "file_storage_path",
        "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys", "enable_metadata_cache", "metadata_ttl",
    }
)  # fmt: skip
TOKEN_HINT = '"token_file": "FILE" in --hicache-storage-backend-extra-config, or KVSTORE_AUTH_TOKEN_FILE'
DEFAULT_TIMEOUT_S = 2.0  # a load or backup runs in SGLang's I/O threads: a hung store holds them no longer
FORGET_AFTER = 1 << 18  # keys remembered for clear()
LOG_EVERY_S = 10.0


class KVStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = {k: v for k, v in (storage_config.extra_config or {}).items() if k not in SGLANG_KEYS}
        self.model_path = extra.pop("model_path", None)
        if "timeout_s" not in extra and "KVSTORE_TIMEOUT_S" not in os.environ:
            extra["timeout_s"] = DEFAULT_TIMEOUT_S
        self.settings = KVTransferConfig.from_mapping(extra)
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError(
                "KVStoreHiCacheStorage: decode context parallel (dcp_size > 1) is not supported"
            )
        if not (storage_config.extra_config or {}).get("interface_v1"):
            logger.warning(
                'KVStoreHiCacheStorage without "interface_v1": 1 in the extra config: SGLang will move '
                "pages through the generic page path (one more copy per page each way)"
            )
        if getattr(storage_config, "should_split_heads", False):
            logger.warning("KVStoreHiCacheStorage keys pages by TP rank and size: no sharing across TP sizes")
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.writer = bool(writer) if writer is not None else not self.is_mla or storage_config.tp_rank == 0
        self.geometry: PageGeometry | None = None
        self.root = b""
        self.shard = shard_of(storage_config)
        self._stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._metrics: dict[str, list] = {
            k: [] for k in ("prefetch_pgs", "backup_pgs", "prefetch_bw", "backup_bw")
        }
        self._lock = threading.Lock()
        self._logged: dict[str, float] = {}
        self._written: OrderedDict[str, None] = OrderedDict()
        self.handle: StoreHandle | None = acquire_store(self.settings, TOKEN_HINT)

    # ---- set-up ----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool whose pages this backend moves: its geometry makes the layout fingerprint."""
        super().register_mem_pool_host(mem_pool_host)
        geo = geometry_of(mem_pool_host)
        layout = page_layout(geo, self.storage_config, self.model_path)
        self.geometry, self.root = geo, root_key(layout, self.settings.namespace)
        logger.info(
            "KVStoreHiCacheStorage: store %s, %s pages of %d tokens (%.2f MiB, host layout %s), %s, "
            "layout %s", self.settings.store_url, geo.kind.upper(), geo.page_size, geo.nbytes / 2**20,
            geo.layout, "writer" if self.writer else "reader (an MLA replica: rank 0 writes)",
            layout.fingerprint().decode(),
        )  # fmt: skip

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's HybridCacheController (every model's in a server) registers each pool of its host pool
        group here: the KV pool is the one `register_mem_pool_host` took; any other is refused at start."""
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ConfigError(
            f"KVStoreHiCacheStorage stores the KV pool only, not SGLang's {host_pool_name} pool (hybrid "
            "models: Mamba, SWA, DSA indexer and draft pools are not supported)"
        )

    # ---- existence (the hit query) ---------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` are stored (one LOOKUP, within `lookup_timeout_s`)."""
        if not keys or not self._usable("exists"):
            return 0
        try:
            kkeys = self._keys(keys)
            n = self.handle.lookup(self.settings.lookup_timeout_s, lambda s: s.lookup_prefix(kkeys))
        except Exception as e:  # noqa: BLE001 (never raise on the data path: a fault is a miss)
            self._fault("exists", e)
            return 0
        self._count(exists_queries=1, exists_pages=len(keys), exists_hits=n)
        return n

    # ---- zero-copy v1: pages straight out of and into the host pool -------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the pages of `keys` into the host pool at `host_indices` (page_size tokens each)."""
        pages = self._pool_pages(keys, host_indices)
        return self._load(keys, pages) if pages is not None else [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Back up the host pool's pages at `host_indices` under `keys`."""
        pages = self._pool_pages(keys, host_indices)
        return self._save(keys, pages) if pages is not None else [False] * len(keys)

    def _pool_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[torch.Tensor] | None:
        try:
            geo, pool = self.geometry, self.mem_pool_host
            if geo is None:
                raise ConfigError("no host pool registered")
            if host_indices.numel() != len(keys) * geo.page_size:
                raise ConfigError(
                    f"{host_indices.numel()} host indices for {len(keys)} pages of {geo.page_size}"
                )
            starts = host_indices.reshape(-1)[:: geo.page_size].tolist()
            return [geo.canonical(pool.get_data_page(s, flat=False)) for s in starts]
        except Exception as e:  # noqa: BLE001
            self._fault("host_pool", e)
            return None

    # ---- the generic page path: flat page tensors --------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page of `keys` into its flat tensor of `target_locations` (fresh ones when None)."""
        try:
            geo = self._geometry()
            flats = list(target_locations) if target_locations is not None else [None] * len(keys)
            flats = [
                torch.empty(geo.nbytes // geo.dtype.itemsize, dtype=geo.dtype) if f is None else f
                for f in flats
            ]
            views = [geo.flat_view(f) for f in flats]
        except Exception as e:  # noqa: BLE001
            self._fault("host_pool", e)
            return [None] * len(keys)
        return [f if ok else None for f, ok in zip(flats, self._load(keys, views), strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Back up flat page tensors; True when every one is stored."""
        try:
            geo = self._geometry()
            views = [geo.flat_view(v) for v in values]
        except Exception as e:  # noqa: BLE001
            self._fault("host_pool", e)
            return False
        return all(self._save(keys, views))

    # ---- the moves -----------------------------------------------------------------------------
    def _load(self, keys: Sequence[str], pages: list[torch.Tensor]) -> list[bool]:
        """Each blob into its page view; the leading run is what SGLang keeps, so a miss ends the copies."""
        n = len(keys)
        ok = [False] * n
        if not n or not self._usable("load"):
            return ok
        t0 = time.perf_counter()
        try:
            kkeys = self._keys(keys)
            reasons: list[str | None] = []
            with self.handle.lease_blobs(kkeys, reasons) as lease:  # a same-host server: its arena, in place
                self._copy(kkeys, pages, lease, range(n), ok)
                intact = lease.intact()
            torn = [i for i in range(n) if ok[i] and not intact[i]]
            if torn:  # overwritten in the server's arena while copied: those again, by request
                self._count(torn=len(torn))
                for i in torn:
                    ok[i] = False
                with self.handle.store.lease_blobs([kkeys[i] for i in torn]) as lease:
                    self._copy([kkeys[i] for i in torn], [pages[i] for i in torn], lease, torn, ok)
        except Exception as e:  # noqa: BLE001
            self._fault("load", e)
            return [False] * n
        hits = _leading(ok)
        self._count(loaded=hits, load_misses=n - hits, loaded_bytes=hits * self.geometry.nbytes)
        self._metric("prefetch", hits, time.perf_counter() - t0)
        return ok

    def _copy(
        self, kkeys: Sequence[str], pages: Sequence[torch.Tensor], lease: Any, where: Any, ok: list
    ) -> None:
        for j, i in enumerate(where):
            blob = lease.blobs[j]
            if blob is None:
                return
            try:
                load_into(pages[j], blob, lease.headers[j], kkeys[j])
            except CorruptBlob as e:
                self._count(corrupt=1)
                self._log("corrupt", "page %s does not load (%s): a miss", kkeys[j], e)
                return
            ok[i] = True

    def _save(self, keys: Sequence[str], pages: list[torch.Tensor]) -> list[bool]:
        """Store the pages not stored yet (one EXISTS, one PUT); all True or all False."""
        n = len(keys)
        if not n:
            return []
        if not self.writer:  # an MLA replica: the writer rank stores the one copy
            return [True] * n
        if not self._usable("save"):
            return [False] * n
        t0 = time.perf_counter()
        try:
            kkeys = self._keys(keys)
            stored = self.handle.batch_exists(kkeys)
            todo = [i for i in range(n) if not stored[i]]
            if todo:
                self.handle.batch_put_blobs([(kkeys[i], self._blob(pages[i], kkeys[i])) for i in todo])
        except Exception as e:  # noqa: BLE001
            self._fault("save", e)
            return [False] * n
        self._count(
            saved=len(todo), already_stored=n - len(todo), saved_bytes=len(todo) * self.geometry.nbytes
        )
        self._metric("backup", len(todo), time.perf_counter() - t0)
        with self._lock:
            for i in todo:
                self._written[kkeys[i]] = None
            while len(self._written) > FORGET_AFTER:
                self._written.popitem(last=False)
        return [True] * n

    def _blob(self, page: torch.Tensor, key: str) -> Any:
        if self.settings.codec == "raw":
            return StridedBlob(page, key)  # laid out where it goes, in one strided copy
        return prepare_blob(page.contiguous(), codec=self.settings.codec, key=key)

    # ---- maintenance -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete the pages this process stored (the last FORGET_AFTER): a store is shared, so pages other
        engines stored stay (the store's LRU and TTL reclaim them)."""
        with self._lock:
            keys, self._written = list(self._written), OrderedDict()
        deleted = 0
        try:
            for i in range(0, len(keys), 4096):
                deleted += self.handle.batch_delete(keys[i : i + 4096])
        except Exception as e:  # noqa: BLE001
            self._fault("clear", e)
        logger.info(
            "KVStoreHiCacheStorage.clear: deleted %d of the %d pages this process stored", deleted, len(keys)
        )

    def stats(self) -> dict[str, int]:
        """Counters since the start: pages queried, hit, loaded, saved, skipped, and faults by kind."""
        with self._lock:
            return dict(self._stats)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s per call since the last get_stats), with
        --enable-hicache-storage-metrics; None without."""
        with self._lock:
            snap = self._metrics
            self._metrics = {k: [] for k in snap}
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415

        m = StorageMetrics()
        m.prefetch_pgs.extend(snap["prefetch_pgs"])
        m.backup_pgs.extend(snap["backup_pgs"])
        m.prefetch_bandwidth.extend(snap["prefetch_bw"])
        m.backup_bandwidth.extend(snap["backup_bw"])
        return m

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            release_store(handle)

    # ---- helpers ---------------------------------------------------------------------------------
    def _geometry(self) -> PageGeometry:
        if self.geometry is None:
            raise ConfigError("no host pool registered")
        return self.geometry

    def _keys(self, hashes: Sequence[str]) -> list[str]:
        self._geometry()
        return page_keys(self.root, self.shard, hashes)

    def _usable(self, op: str) -> bool:
        """False (a miss, counted) while the store is skipped after a failure, or after close()."""
        if self.handle is not None and self.handle.reachable() and self.geometry is not None:
            return True
        self._count(skipped=1)
        return False

    def _fault(self, op: str, err: BaseException) -> None:
        self._count(**{f"faults_{op}": 1})
        if isinstance(err, KVStoreError) and is_unreachable(err) and self.handle is not None:
            self.handle.mark_unreachable(err)
        self._log(op, "KVStoreHiCacheStorage %s failed (%s: %s): a miss", op, type(err).__name__, err)

    def _log(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._logged.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
                return
            self._logged[kind] = now
        logger.warning(msg, *args)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] = self._stats.get(k, 0) + v

    def _metric(self, kind: str, pages: int, seconds: float) -> None:
        if pages and self.storage_config.enable_storage_metrics:
            gbps = pages * self.geometry.nbytes / 1e9 / max(seconds, 1e-9)
            with self._lock:
                self._metrics[f"{kind}_pgs"].append(pages)
                self._metrics[f"{kind}_bw"].append(gbps)


STAT_NAMES = (
    "exists_queries", "exists_pages", "exists_hits", "loaded", "load_misses", "loaded_bytes", "corrupt",
    "torn", "saved", "already_stored", "saved_bytes", "skipped",
    "faults_exists", "faults_load", "faults_save", "faults_host_pool", "faults_clear",
)  # fmt: skip


def _leading(ok: Sequence[bool]) -> int:
    return next((i for i, x in enumerate(ok) if not x), len(ok))
