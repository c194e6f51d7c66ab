"""One store connection (and one set of metrics) per process and store, shared by the connectors.

The scheduler-side and worker-side connectors of an engine live in one process here; with
`store_url: local` they must see the SAME in-process store (two separate ones would never hit), so
connectors acquire a reference-counted handle keyed by where the store is, and the last `release`
closes it.

The handle also remembers when the store last failed: for `unreachable_backoff_s` after a failure
the connectors skip it (a miss, counted as `unreachable`) instead of paying a connection timeout on
every engine step (kvstore/breaker.py's circuit breaker, with a fixed backoff; once it has passed
every caller may try). Lookups, the only store calls inside an engine step, end
after `lookup_timeout_s` (a miss that opens the breaker); loads and saves run in the background.
Inference never waits on a dead or hung store for longer than that.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.metrics import ConnectorMetrics

from kvstore.blob import PreparedBlob
from kvstore.breaker import Breaker
from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError, Forbidden, KVStoreError, Unauthorized, Unavailable
from kvstore.protocol import Blob

logger = logging.getLogger(__name__)
T = TypeVar("T")


def is_unreachable(err: KVStoreError) -> bool:
    """The store did not answer, or answered with a server-side failure (not a bad request of ours)."""
    return isinstance(err, Unavailable) or err.status >= 500


class StoreHandle:
    def __init__(
        self,
        key: tuple,
        store: Any,
        backoff_s: float,
        lookups: Any = None,
        in_memory: bool = False,
        clock: Clock = SYSTEM,
    ) -> None:
        """`clock`: what the backoff is timed on (kvstore/clock.py; a test's `ManualClock`)."""
        self.key = key
        self.store = store  # sdk.Store
        self.lookups = lookups  # a second sdk.Store with a short timeout for lookups (remote), or None
        # an in-process store of memory tiers only cannot hang: its lookups run on the caller's thread
        # (a thread hop per lookup cost the engine more than the lookup itself)
        self.in_memory = in_memory
        self.metrics = ConnectorMetrics()
        self.refs = 0
        self._backoff_s = backoff_s
        self._breaker = Breaker(backoff_s, backoff_s, clock)
        self._lock = threading.Lock()
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kv-lookup")

    # ---- reachability -----------------------------------------------------------------------
    def reachable(self) -> bool:
        return not self._breaker.refusing()

    def mark_unreachable(self, err: Exception) -> None:
        with self._lock:
            first = self.reachable()  # logged once per backoff
            self._breaker.failure()
        if first:
            logger.warning("KV store unreachable (%s); skipping it for %.1f s", err, self._backoff_s)

    # ---- lookups: called inside an engine step, so they have a deadline ----------------------
    def _lookup_store(self) -> Any:
        return self.lookups if self.lookups is not None else self.store

    def _within(self, deadline_s: float, fn: Any, *args: Any) -> Any:
        """`fn(*args)` or Unavailable after `deadline_s`: a hung store costs the step this much, no more
        (the call itself ends in the background, at the lookup client's own socket timeout)."""
        if self.in_memory:
            return fn(*args)
        fut = self._lookup_pool.submit(fn, *args)
        try:
            return fut.result(timeout=deadline_s)
        except FutureTimeout:
            fut.cancel()
            raise Unavailable(
                f"the KV store did not answer a lookup within {deadline_s * 1e3:.0f} ms"
            ) from None

    def lookup(self, deadline_s: float, fn: Callable[[Any], T]) -> T:
        """`fn(store)` on the lookup client (its `lookup` / `batch_exists` calls), within the deadline."""
        return self._within(deadline_s, fn, self._lookup_store())

    # ---- blob-level calls (the connector encodes and decodes itself) --------------------------
    def lease_blobs(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> Any:
        """The chunks' blobs lent until `release()` (sdk.buffers.BlobLease): no copy from a server on
        this host (shared memory; in place: check `intact()` after use) or from an in-process store."""
        return self.store.lease_blobs(list(keys), reasons, in_place=True)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.batch_exists(list(keys))

    def batch_put_blobs(
        self,
        items: Sequence[tuple[str, Blob | PreparedBlob]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[Sequence[int] | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> None:
        """Store the blobs (a PreparedBlob is laid out where it goes: a same-host server's shared
        memory), then delete `replaces`, only once every blob is stored; one round trip to a server.
        `token_ids` / `parents`: per blob, hints for the server's KV events (kvstore.token_hints)."""
        if token_ids is not None and not any(t is not None for t in token_ids):
            token_ids = parents = None
        self.store.batch_put(list(items), list(replaces), token_ids, parents)

    def batch_delete(self, keys: Sequence[str]) -> int:
        return self.store.batch_delete(list(keys))

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        if self.lookups is not None:
            self.lookups.close()
        self.store.close()


_POOL: dict[tuple, StoreHandle] = {}
_POOL_LOCK = threading.Lock()


def _pool_key(config: KVTransferConfig) -> tuple:
    if config.is_local:
        return ("local", config.local_store_config().model_dump_json())
    token = config.token()  # keyed by a digest: the key is no place for a token (reprs, logs)
    return ("remote", config.store_url, token and hashlib.sha256(token.encode()).hexdigest())


def _open_store(config: KVTransferConfig, timeout_s: float, retries: int) -> Any:
    from kvstore.sdk import Store  # noqa: PLC0415 (the sdk stays out of engines that run without a store)

    if config.is_local:
        return Store.local(config=config.local_store_config())
    return Store.connect(
        config.store_url,
        token=config.token(),
        timeout=timeout_s,
        connect_timeout=min(timeout_s, 2.0),
        retries=retries,
    )


# how to pass the token, in each engine's own terms (the message of a rejected token names it)
ENGINE_TOKEN_HINT = (
    "--kv-store-token-file FILE (kv_connector_extra_config auth_token_file, or KVSTORE_AUTH_TOKEN_FILE)"
)


def _check_access(store: Any, config: KVTransferConfig, token_hint: str) -> None:
    """One authenticated call at startup: a rejected token stops the engine here, with a clear
    message naming `token_hint`, instead of an engine that looks healthy and logs an error per request.
    A server that refuses everyone (403) stops it too. A store that does not answer yet is not fatal
    (the connector treats it as unreachable and retries later), nor is another 4xx (logged as what it
    is: an answer, e.g. from a URL that is not a kvstore-server)."""
    try:
        store.stats()
    except Unauthorized:
        store.close()
        how = "the token was rejected" if config.token() else "it requires a token"
        raise ConfigError(
            f"the kvstore-server at {config.store_url} refused access: {how}; pass the server's token with "
            f"{token_hint}"
        ) from None
    except Forbidden as e:  # refused whoever asks (a Host name without a token): so would every call be
        store.close()
        raise ConfigError(f"the kvstore-server at {config.store_url} refused access (403): {e}") from None
    except KVStoreError as e:
        if is_unreachable(e):
            logger.warning(
                "the kvstore-server at %s does not answer yet (%s); continuing without it",
                config.store_url,
                e,
            )
        else:  # it answered, with a 4xx: a wrong URL (not a kvstore-server?) or a request it cannot take
            logger.warning(
                "the kvstore-server at %s answered the startup check with HTTP %d %s (%s); is the URL a "
                "kvstore-server? continuing",
                config.store_url, e.status, type(e).__name__, e,
            )  # fmt: skip


def _open_handle(key: tuple, config: KVTransferConfig, token_hint: str) -> StoreHandle:
    store = _open_store(config, config.timeout_s, config.retries)
    if not config.is_local:
        _check_access(store, config, token_hint)
    lookups = None
    if not config.is_local:  # a hung server must not hold a lookup thread for timeout_s
        try:
            lookups = _open_store(config, 4 * config.lookup_timeout_s, 1)  # 1: a stale pooled socket
        except BaseException:
            store.close()
            raise
    in_memory = config.is_local and set(config.local_tiers) <= {"cpu"}
    return StoreHandle(key, store, config.unreachable_backoff_s, lookups, in_memory)


def acquire_store(config: KVTransferConfig, token_hint: str = ENGINE_TOKEN_HINT) -> StoreHandle:
    """The shared handle of `config`'s store; `token_hint` tells the user of a rejected token how to
    pass one to this engine."""
    key = _pool_key(config)
    with _POOL_LOCK:
        handle = _POOL.get(key)
        if handle is None:
            handle = _POOL[key] = _open_handle(key, config, token_hint)
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
    handle.close()
