"""The redis tier: blobs in Redis or Valkey, standalone or Cluster (DESIGN.md, Spec 4).

- One key per blob, `{redis_prefix}{chunk key}` -> the blob bytes: a header and its payload can never
  drift apart. Two prefixes (namespaces) never see each other's keys unless one starts with the other
  (`a:` and `a:b:` overlap). Optional TTL per key (`SET .. PX`).
- URLs: `redis://[user:password@]host:port/db`, `rediss://` for TLS (`?ssl_ca_certs=/path/ca.pem`,
  `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs=none|optional|required`). Cluster (`redis_cluster`):
  keys spread over the hash slots of all primaries; list several startup nodes as
  `redis://h1:7000,h2:7001,h3:7002` (db must be 0). Keep `{}` out of the prefix, or every key hashes
  to one slot.
- Capacity is the server's: run it with `maxmemory <bytes>` and `maxmemory-policy allkeys-lru` (each
  Cluster primary has its own). Redis evicts; `put` cannot know which keys went and returns [].
  `capacity` is the sum of the primaries' maxmemory (unbounded when 0, which is logged as a warning).
  For a Cluster used as a cache, `cluster-require-full-coverage no` keeps the other shards serving
  while one is down.
- Byte accounting: `usage()`/`len()` come from an index of key -> blob size that this process keeps:
  rebuilt by SCAN + STRLEN/PTTL at start, after every reconnect and on `reconcile()`, and updated by
  each put/get/delete (a hit teaches it blobs written by other processes; a miss on a known key
  counts as `stats.expired` when its TTL had passed, else `stats.evictions`). `keys()` asks the
  server. The server's own view is in `stats.extra` (server_used_memory, server_evicted_keys...).
- Faults never raise out of the tier: a get is a miss, a put is dropped and counted (`stats.errors`,
  `stats.dropped_puts`), errors are logged once per outage. Each server (each Cluster primary) has a
  circuit breaker: after a failure it is skipped without touching the network for a backoff that
  doubles from 0.1 s to 5 s (those calls count in `stats.extra["fast_fails"]`), then one caller
  probes it; the tier reconnects on its own. Timeouts: connect 0.5 s, each socket operation 2 s.
- Speed: values are sent as they are (redis-py's hiredis packer copies each one) and hiredis' replies
  are returned as they are; a batch is one MGET (standalone) or one pipeline per primary, the
  primaries asked concurrently (Cluster). `contains_many` is one pipeline of EXISTS per server, so a
  prefix lookup through the store costs one round trip, not one per key.
- Files: this one is the Tier protocol; `redis_conn.py` reaches the servers (URLs, connections,
  routing, breakers); `redis_index.py` keeps the byte accounting.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.exceptions import AskError

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.lru import check_ttl
from kvstore.tiers.base import Blob, TierStats
from kvstore.tiers.redis_conn import (
    BACKEND_ERRORS,
    CONNECT_TIMEOUT_S,
    FAIL,
    SOCKET_TIMEOUT_S,
    Endpoint,
    RedisServers,
    pipelined,
)
from kvstore.tiers.redis_index import SCAN_BATCH, KeyIndex, Sizes, glob_escape, scan_sizes

log = logging.getLogger(__name__)

UNBOUNDED = sys.maxsize


class RedisTier:
    """Blobs in Redis/Valkey. Thread-safe (redis-py pools connections; the index has a lock)."""

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvstore:",
        cluster: bool = False,
        server_maxmemory: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
    ) -> None:
        """`server_maxmemory`: CONFIG SET maxmemory (+ allkeys-lru) on every primary at each connect,
        for deployments that own their Redis (tests, benchmarks); None leaves the server as it is."""
        self.url, self.prefix, self.cluster = url, prefix, cluster
        self._raw_prefix = prefix.encode()
        self.server_maxmemory = server_maxmemory
        self.capacity = UNBOUNDED
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index = KeyIndex(self.stats)
        self._reconciling = False
        self._reconciler: threading.Thread | None = None
        self._servers = RedisServers(
            url, cluster, self.stats, self._reconcile_in_background, connect_timeout_s, socket_timeout_s
        )
        self.reconcile()
        if self._servers.auth_error is not None:
            self.close()
            raise ConfigError(f"redis at {url!r} refused our credentials: {self._servers.auth_error}")

    @classmethod
    def from_config(cls, config: StoreConfig) -> RedisTier:
        return cls(config.redis_url, prefix=config.redis_prefix, cluster=config.redis_cluster)

    # ---- keys ----------------------------------------------------------------------------------

    def _rk(self, key: str) -> bytes:
        return self._raw_prefix + key.encode()

    def _group(self, keys: Sequence[str]) -> dict[Endpoint | None, list[int]]:
        return self._servers.group([self._rk(k) for k in keys])

    # ---- the index behind usage() and len() ---------------------------------------------------

    def usage(self) -> int:
        """Blob bytes this process knows to be in Redis (see the module docstring)."""
        return self._index.usage()

    def __len__(self) -> int:
        return len(self._index)

    def reconcile(self) -> None:
        """Rebuild the index from the servers (SCAN our prefix, STRLEN + PTTL) and refresh server stats."""
        self._index.begin_rebuild()
        found: Sizes = {}
        scanned: set[str] = set()
        maxmemory: list[int] = []
        try:
            for ep in self._servers.primaries():
                part = self._servers.call(ep, lambda c: scan_sizes(c, self._raw_prefix))
                info = self._servers.call(ep, self._server_info) if part is not FAIL else FAIL
                if part is FAIL or info is FAIL:
                    continue
                scanned.add(ep.name)
                found.update(part)
                maxmemory.append(info)
        finally:
            self._index.finish_rebuild(found, scanned, self._owner)
        if maxmemory:
            self.capacity = UNBOUNDED if 0 in maxmemory else sum(maxmemory)

    def _reconcile_in_background(self) -> None:
        with self._lock:
            if self._reconciling:
                return
            self._reconciling = True

        def run() -> None:
            try:
                self.reconcile()
            except BACKEND_ERRORS as e:
                self._servers.warn("reconcile", "redis reconcile failed: %s", e)
            finally:
                self._reconciling = False

        self._reconciler = threading.Thread(target=run, name="redis-tier-reconcile", daemon=True)
        self._reconciler.start()

    def _owner(self, key: str) -> str | None:
        return self._servers.owner(self._rk(key))

    def _server_info(self, client: redis.Redis) -> int:
        """Applies server_maxmemory if asked; records the server's counters; returns its maxmemory."""
        if self.server_maxmemory is not None:
            client.config_set("maxmemory-policy", "allkeys-lru")
            client.config_set("maxmemory", self.server_maxmemory)
        info = {**client.info("memory"), **client.info("stats")}
        for field in ("used_memory", "maxmemory", "evicted_keys", "expired_keys"):
            self.stats.extra[f"server_{field}"] = float(info.get(field, 0))
        policy = str(info.get("maxmemory_policy", ""))
        if not int(info.get("maxmemory", 0)):
            self._servers.warn(
                "maxmemory",
                "redis has no maxmemory: it grows until it is killed; set maxmemory and allkeys-lru",
            )
        elif not policy.startswith("allkeys-"):
            self._servers.warn(
                "policy", "redis maxmemory-policy is %s: puts fail when full; use allkeys-lru", policy
            )
        return int(info.get("maxmemory", 0))

    # ---- the Tier protocol ---------------------------------------------------------------------

    def get(self, key: str) -> Blob | None:
        rkey = self._rk(key)
        return self._seen(key, self._servers.call(self._servers.endpoint(rkey), lambda c: c.get(rkey)))

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        out: list[Blob | None] = [None] * len(keys)

        def fetch(ep: Endpoint | None, idx: list[int]) -> None:
            rkeys = [self._rk(keys[i]) for i in idx]
            if self.cluster:
                values = self._servers.call(ep, lambda c: pipelined(c, [("get", rk) for rk in rkeys]))
            else:
                values = self._servers.call(ep, lambda c: c.mget(rkeys))
            for j, i in enumerate(idx):
                out[i] = self._seen(keys[i], FAIL if values is FAIL else values[j])

        self._servers.per_node(self._group(keys), fetch)
        return out

    def _failed(self, op: str, key: str, reply: Any) -> bool:
        """True for a reply that carries no answer (server down, or an error, counted here)."""
        if reply is FAIL:
            return True
        if isinstance(reply, Exception):
            self._servers.count_error(type(reply).__name__, f"redis {op} %s: %s", key, reply)
            if isinstance(reply, AskError):
                self._servers.refresh_topology()
            return True
        return False

    def _seen(self, key: str, value: Any) -> Blob | None:
        if self._failed("get", key, value):
            return None
        if value is None:
            self._index.forget(key, missed=True)
            return None
        known = self._index.get(key)
        if known is None or known[0] != len(value):
            self._index.remember(key, len(value), known[1] if known else None)
        return value

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        return self.put_many([(key, blob)], ttl_s)

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        px = _px(ttl_s)
        keys = [k for k, _ in items]
        values = [_value(blob) for _, blob in items]

        def store(ep: Endpoint | None, idx: list[int]) -> None:
            fits = [i for i in idx if values[i][1] <= self.capacity]
            for i in set(idx) - set(fits):  # larger than the whole server: not stored, old blob gone
                self.delete(keys[i])
            if not fits:
                return
            cmds = [("set", self._rk(keys[i]), values[i][0], px) for i in fits]
            if len(cmds) == 1:
                res = self._servers.call(ep, lambda c: [c.set(cmds[0][1], cmds[0][2], px=px)])
            else:
                res = self._servers.call(ep, lambda c: pipelined(c, cmds))
            for j, i in enumerate(fits):
                self._stored(keys[i], values[i][1], FAIL if res is FAIL else res[j], ttl_s)

        self._servers.per_node(self._group(keys), store)
        return []  # the server evicts on its own; see the module docstring

    def _stored(self, key: str, size: int, reply: Any, ttl_s: float | None) -> None:
        if reply is FAIL or isinstance(reply, Exception) or not reply:
            if isinstance(reply, Exception):
                self._servers.count_error(type(reply).__name__, "redis put %s: %s", key, reply)
            self.stats.dropped_puts += 1
            return
        self._index.remember(key, size, time.monotonic() + ttl_s if ttl_s else None)

    def contains(self, key: str) -> bool:
        rkey = self._rk(key)
        return self._exists(key, self._servers.call(self._servers.endpoint(rkey), lambda c: c.exists(rkey)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` for each key in one round trip per server (pipelined EXISTS); down => False."""
        out = [False] * len(keys)

        def check(ep: Endpoint | None, idx: list[int]) -> None:
            cmds = [("exists", self._rk(keys[i])) for i in idx]
            replies = self._servers.call(ep, lambda c: pipelined(c, cmds))
            for j, i in enumerate(idx):
                out[i] = self._exists(keys[i], FAIL if replies is FAIL else replies[j])

        self._servers.per_node(self._group(keys), check)
        return out

    def _exists(self, key: str, reply: Any) -> bool:
        if self._failed("exists", key, reply):
            return False
        if not reply:
            self._index.forget(key, missed=True)
        return bool(reply)

    def delete(self, key: str) -> bool:
        rkey = self._rk(key)
        n = self._servers.call(self._servers.endpoint(rkey), lambda c: c.delete(rkey))
        if n is FAIL:
            return False
        self._index.forget(key)
        return bool(n)

    def keys(self) -> Iterator[str]:
        """Our keys as the servers list them now (SCAN per primary; a primary that is down is skipped)."""
        match = glob_escape(self._raw_prefix) + b"*"
        for ep in self._servers.primaries():
            cursor = 0
            while True:
                page = self._servers.call(
                    ep, lambda c, cur=cursor: c.scan(cur, match=match, count=SCAN_BATCH)
                )
                if page is FAIL:
                    break
                cursor, rkeys = page
                for rkey in rkeys:
                    yield rkey[len(self._raw_prefix) :].decode(errors="replace")
                if cursor == 0:
                    break

    def close(self) -> None:
        self._servers.closed = True  # a running reconcile stops at its next call
        if self._reconciler is not None and self._reconciler is not threading.current_thread():
            self._reconciler.join(timeout=self._servers.socket_timeout_s * 2 + 1)
        self._servers.close()


def _value(blob: Blob) -> tuple[bytes | memoryview, int]:
    """The blob as redis-py sends it without a copy, and its size in bytes."""
    if isinstance(blob, bytes):
        return blob, len(blob)
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv, mv.nbytes


def _px(ttl_s: float | None) -> int | None:
    if check_ttl(ttl_s) is None:
        return None
    return max(1, math.ceil(ttl_s * 1000))
