"""One store connection (and one set of metrics) per process and store, shared by the connectors.

The scheduler-side and worker-side connectors of an engine live in one process here; with
`store_url: local` they must see the SAME in-process store (two separate ones would never hit), so
connectors acquire a reference-counted handle keyed by where the store is, and the last `release`
closes it.

The handle also remembers when the store last failed: for `unreachable_backoff_s` after a failure
the connectors skip it (a miss, counted as `unreachable`) instead of paying a connection timeout on
every engine step. Inference never waits on a dead store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from connectors.config import KVTransferConfig
from connectors.metrics import ConnectorMetrics
from kvstore.errors import ConfigError, KVStoreError, Unauthorized, Unavailable
from kvstore.tiers.base import Blob

logger = logging.getLogger(__name__)


def is_unreachable(err: KVStoreError) -> bool:
    """The store did not answer, or answered with a server-side failure (not a bad request of ours)."""
    return isinstance(err, Unavailable) or err.status >= 500


class StoreHandle:
    def __init__(self, key: tuple, store: Any, backoff_s: float) -> None:
        self.key = key
        self.store = store  # sdk.Store
        self.metrics = ConnectorMetrics()
        self.refs = 0
        self._backoff_s = backoff_s
        self._down_until = 0.0
        self._lock = threading.Lock()

    # ---- reachability -----------------------------------------------------------------------
    def reachable(self) -> bool:
        return time.monotonic() >= self._down_until

    def mark_unreachable(self, err: Exception) -> None:
        with self._lock:
            first = self.reachable()
            self._down_until = time.monotonic() + self._backoff_s
        if first:
            logger.warning("KV store unreachable (%s); skipping it for %.1f s", err, self._backoff_s)

    # ---- blob-level calls (the connector encodes and decodes itself) --------------------------
    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        """(leading chunks stored, the store's reason the next one is missing)."""
        return self.store.lookup(list(keys))

    def lease_blobs(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> Any:
        """The chunks' blobs lent until `release()` (sdk.buffers.BlobLease): no copy from a server on
        this host (shared memory) or from an in-process store."""
        return self.store.lease_blobs(list(keys), reasons)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.batch_exists(list(keys))

    def batch_put_blobs(self, items: Sequence[tuple[str, Blob]]) -> None:
        self.store.batch_put(list(items))


_POOL: dict[tuple, StoreHandle] = {}
_POOL_LOCK = threading.Lock()


def _pool_key(config: KVTransferConfig) -> tuple:
    if config.is_local:
        return ("local", config.local_store_config().model_dump_json())
    return ("remote", config.store_url, config.token())


def _open_store(config: KVTransferConfig) -> Any:
    from sdk import Store  # noqa: PLC0415 (the sdk stays out of engines that run without a store)

    if config.is_local:
        return Store.local(config=config.local_store_config())
    store = Store.connect(
        config.store_url,
        token=config.token(),
        timeout=config.timeout_s,
        connect_timeout=min(config.timeout_s, 2.0),
        retries=config.retries,
    )
    _check_access(store, config)
    return store


def _check_access(store: Any, config: KVTransferConfig) -> None:
    """One authenticated call at startup: a rejected token stops the engine here, with a clear
    message, instead of an engine that looks healthy and logs an error per request. A store that does
    not answer yet is not fatal (the connector treats it as unreachable and retries later)."""
    try:
        store.stats()
    except Unauthorized:
        store.close()
        how = "the token was rejected" if config.token() else "it requires a token"
        raise ConfigError(
            f"the kvstore-server at {config.store_url} refused access: {how}; pass the server's token with "
            "--kv-store-token-file FILE (kv_connector_extra_config auth_token_file, or KVSTORE_AUTH_TOKEN_FILE)"
        ) from None
    except KVStoreError as e:
        logger.warning(
            "the kvstore-server at %s does not answer yet (%s); continuing without it", config.store_url, e
        )


def acquire_store(config: KVTransferConfig) -> StoreHandle:
    key = _pool_key(config)
    with _POOL_LOCK:
        handle = _POOL.get(key)
        if handle is None:
            handle = _POOL[key] = StoreHandle(key, _open_store(config), config.unreachable_backoff_s)
        handle.refs += 1
        return handle


def release_store(handle: StoreHandle) -> None:
    with _POOL_LOCK:
        assert handle.refs > 0, "released a store handle more often than it was acquired"
        handle.refs -= 1
        if handle.refs:
            return
        if _POOL.get(handle.key) is handle:
            del _POOL[handle.key]
    handle.store.close()
