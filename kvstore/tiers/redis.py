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
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import PythonRespSerializer, parse_url
from redis.crc import key_slot
from redis.exceptions import AskError, AuthenticationError, RedisClusterException
from redis.retry import Retry

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.tiers.base import Blob, TierStats

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 2.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
SCAN_BATCH = 1000
UNBOUNDED = sys.maxsize
_BACKEND_ERRORS = (redis.RedisError, RedisClusterException, OSError)
_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_FAIL = object()  # a call that did not reach the server (or that the server refused)


class _ZeroCopyConnection(redis.Connection):
    """Sends values as they are: redis-py's hiredis packer copies every value into one new buffer."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class _ZeroCopySSLConnection(redis.SSLConnection):
    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class _Breaker:
    """Closed while calls succeed; after a failure, open (callers fail fast) until one probe succeeds."""

    def __init__(self) -> None:
        self.down = False
        self.delay = BACKOFF_MIN_S
        self.until = 0.0

    def allow(self, now: float) -> bool:
        if not self.down:
            return True
        if now < self.until:
            return False
        self.until = now + self.delay  # this caller probes; the others keep failing fast meanwhile
        return True

    def failure(self, now: float) -> bool:
        """Returns True when this failure starts an outage."""
        started = not self.down
        self.delay = BACKOFF_MIN_S if started else min(self.delay * 2, BACKOFF_MAX_S)
        self.down, self.until = True, now + self.delay
        return started

    def success(self) -> bool:
        """Returns True when this success ends an outage."""
        ended, self.down, self.delay = self.down, False, BACKOFF_MIN_S
        return ended


class _Endpoint:
    """One server: its client and its breaker."""

    def __init__(self, name: str, client: redis.Redis) -> None:
        self.name, self.client, self.breaker = name, client, _Breaker()


def _split_url(url: str) -> tuple[str, dict[str, Any], list[tuple[str, int]]]:
    """The URL cut to its first host, redis-py connection options from it, and every host:port listed."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"redis_url must start with redis:// or rediss://, got {url!r}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in filter(None, hostlist.split(",")):
        host, _, port = item.rpartition(":") if item.rpartition(":")[2].isdigit() else (item, "", "6379")
        hosts.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not hosts:
        raise ConfigError(f"redis_url names no host: {url!r}")
    if not (parts.path.strip("/") or "0").isdigit():
        raise ConfigError(f"redis_url path must be a db number, got {parts.path!r} in {url!r}")
    first = f"{userinfo}@{hosts[0][0]}:{hosts[0][1]}" if userinfo else f"{hosts[0][0]}:{hosts[0][1]}"
    first_url = urlunsplit(parts._replace(netloc=first))
    try:
        options = parse_url(first_url)
    except ValueError as e:
        raise ConfigError(f"bad redis_url {url!r}: {e}") from None
    return first_url, options, hosts


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
        self._index: dict[str, tuple[int, float | None]] = {}  # key -> (size, monotonic expiry)
        self._bytes = 0
        self._n_ttl = 0
        self._touched: set[str] | None = None  # keys changed while a reconcile runs
        self._reconciling = False
        self._reconciler: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # concurrent batches over Cluster primaries
        self._socket_timeout_s = socket_timeout_s
        self._last_log: dict[str, float] = {}
        self._closed = False
        first_url, options, self._hosts = _split_url(url)
        timeouts = dict(socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s)
        no_retry = Retry(NoBackoff(), 0)  # our breaker does the retrying; callers never wait
        tls = options.pop("connection_class", redis.Connection) is redis.SSLConnection
        self._endpoints: dict[str, _Endpoint] = {}
        self._rc: RedisCluster | None = None
        self._slot_eps: dict[int, _Endpoint] = {}  # hash slot -> its primary, until the topology changes
        if cluster:
            if options.get("db", 0) != 0:
                raise ConfigError("Redis Cluster has only db 0; drop the /db from redis_url")
            self._cluster_args = dict(
                url=first_url,
                startup_nodes=[ClusterNode(h, p) for h, p in self._hosts[1:]],
                retry=no_retry,
                **timeouts,
                **({} if tls else {"connection_class": _ZeroCopyConnection}),
            )
            self._cluster_breaker = _Breaker()
        else:
            if len(self._hosts) != 1:
                raise ConfigError("several hosts in redis_url need redis_cluster: true")
            cls = _ZeroCopySSLConnection if tls else _ZeroCopyConnection
            pool = redis.ConnectionPool(connection_class=cls, retry=no_retry, **timeouts, **options)
            name = "{}:{}".format(*self._hosts[0])
            self._endpoints[name] = _Endpoint(name, redis.Redis(connection_pool=pool))
        self._auth_error: Exception | None = None
        self.reconcile()
        if self._auth_error is not None:
            self.close()
            raise ConfigError(f"redis at {url!r} refused our credentials: {self._auth_error}")

    @classmethod
    def from_config(cls, config: StoreConfig) -> RedisTier:
        return cls(config.redis_url, prefix=config.redis_prefix, cluster=config.redis_cluster)

    # ---- routing and fault handling ------------------------------------------------------------

    def _cluster_client(self) -> RedisCluster | None:
        if self._rc is not None:
            return self._rc
        if not self._cluster_breaker.allow(time.monotonic()):
            return None
        try:
            self._rc = RedisCluster(**self._cluster_args)
        except _BACKEND_ERRORS as e:
            if isinstance(e, AuthenticationError):
                self._auth_error = e
            self.stats.errors += 1
            self._cluster_breaker.failure(time.monotonic())
            self._warn("cluster", "redis cluster %s unreachable: %s", self.url, e)
            return None
        self._cluster_breaker.success()
        return self._rc

    def _endpoint_named(self, host: str, port: int, client: redis.Redis) -> _Endpoint:
        name = f"{host}:{port}"
        ep = self._endpoints.get(name)
        if ep is None or ep.client is not client:
            ep = self._endpoints[name] = _Endpoint(name, client)
        return ep

    def _endpoint(self, rkey: bytes) -> _Endpoint | None:
        if not self.cluster:
            return next(iter(self._endpoints.values()))
        slot = key_slot(rkey)
        ep = self._slot_eps.get(slot)
        if ep is not None:
            return ep
        rc = self._cluster_client()
        if rc is None:
            return None
        try:
            node = rc.nodes_manager.get_node_from_slot(slot)
        except _BACKEND_ERRORS:
            return None
        ep = self._slot_eps[slot] = self._endpoint_named(node.host, node.port, rc.get_redis_connection(node))
        return ep

    def _primaries(self) -> list[_Endpoint]:
        if not self.cluster:
            return list(self._endpoints.values())
        rc = self._cluster_client()
        if rc is None:
            return []
        return [self._endpoint_named(n.host, n.port, rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def _call(self, ep: _Endpoint | None, fn: Callable[[redis.Redis], Any]) -> Any:
        """fn(client), or _FAIL (counted, logged) when the server is down, in backoff or refuses."""
        if ep is None or self._closed:
            return _FAIL
        if not ep.breaker.allow(time.monotonic()):
            self.stats.extra["fast_fails"] = self.stats.extra.get("fast_fails", 0) + 1
            return _FAIL
        try:
            result = fn(ep.client)
        except AskError as e:  # MOVED/ASK: the cluster was resharded under us
            self._count_error("moved", "redis %s: %s; refreshing the slot map", ep.name, e)
            self._refresh_topology()
            return _FAIL
        except _NETWORK_ERRORS as e:
            if isinstance(e, AuthenticationError):
                self._auth_error = e
            self.stats.errors += 1
            if ep.breaker.failure(time.monotonic()):
                log.warning(
                    "redis %s is down (%s: %s); failing fast and retrying with backoff",
                    ep.name,
                    type(e).__name__,
                    e,
                )
            ep.client.connection_pool.disconnect(inuse_connections=False)
            self._refresh_topology()
            return _FAIL
        except _BACKEND_ERRORS as e:
            self._count_error(type(e).__name__, "redis %s: %s: %s", ep.name, type(e).__name__, e)
            return _FAIL
        if ep.breaker.success():
            log.warning("redis %s is back", ep.name)
            self._reconcile_in_background()
        return result

    def _refresh_topology(self) -> None:
        self._slot_eps = {}
        if self._rc is not None:
            try:
                self._rc.nodes_manager.initialize()
            except _BACKEND_ERRORS as e:
                log.debug("cluster topology refresh failed: %s", e)

    def _count_error(self, kind: str, msg: str, *args: object) -> None:
        self.stats.errors += 1
        self._warn(kind, msg, *args)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -math.inf) >= 10.0:
            self._last_log[kind] = now
            log.warning(msg, *args)

    def _rk(self, key: str) -> bytes:
        return self._raw_prefix + key.encode()

    def _group(self, keys: Sequence[str]) -> dict[_Endpoint | None, list[int]]:
        groups: dict[_Endpoint | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._endpoint(self._rk(key)), []).append(i)
        return groups

    # ---- the index behind usage() and len() ---------------------------------------------------

    def _remember(self, key: str, size: int, expires: float | None) -> None:
        with self._lock:
            old = self._index.get(key)
            if old is not None:
                self._bytes -= old[0]
                self._n_ttl -= old[1] is not None
            self._index[key] = (size, expires)
            self._bytes += size
            self._n_ttl += expires is not None
            if self._touched is not None:
                self._touched.add(key)

    def _forget(self, key: str, missed: bool = False) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if self._touched is not None:
                self._touched.add(key)
            if old is None:
                return
            self._bytes -= old[0]
            self._n_ttl -= old[1] is not None
        if missed:  # gone from the server without our delete
            if old[1] is not None and old[1] <= time.monotonic():
                self.stats.expired += 1
            else:
                self.stats.evictions += 1

    def _purge_expired(self) -> None:
        if not self._n_ttl:
            return
        now = time.monotonic()
        with self._lock:
            gone = [k for k, (_, exp) in self._index.items() if exp is not None and exp <= now]
        for key in gone:
            self._forget(key, missed=True)

    def usage(self) -> int:
        """Blob bytes this process knows to be in Redis (see the module docstring)."""
        self._purge_expired()
        return self._bytes

    def __len__(self) -> int:
        self._purge_expired()
        return len(self._index)

    def reconcile(self) -> None:
        """Rebuild the index from the servers (SCAN our prefix, STRLEN + PTTL) and refresh server stats."""
        with self._lock:
            self._touched = set()
        found: dict[str, tuple[int, float | None]] = {}
        scanned: set[str] = set()
        maxmemory: list[int] = []
        try:
            for ep in self._primaries():
                part = self._call(ep, self._scan_sizes)
                info = self._call(ep, self._server_info) if part is not _FAIL else _FAIL
                if part is _FAIL or info is _FAIL:
                    continue
                scanned.add(ep.name)
                found.update(part)
                maxmemory.append(info)
        finally:
            with self._lock:
                touched, self._touched = self._touched or set(), None
                keep = {  # what we knew about servers we could not scan stays as it was
                    k: v
                    for k, v in self._index.items()
                    if not scanned or k in touched or self._owner(k) not in scanned
                }
                found = {k: v for k, v in found.items() if k not in touched}
                self._index = {**found, **keep}
                self._bytes = sum(size for size, _ in self._index.values())
                self._n_ttl = sum(exp is not None for _, exp in self._index.values())
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
            except _BACKEND_ERRORS as e:
                self._warn("reconcile", "redis reconcile failed: %s", e)
            finally:
                self._reconciling = False

        self._reconciler = threading.Thread(target=run, name="redis-tier-reconcile", daemon=True)
        self._reconciler.start()

    def _owner(self, key: str) -> str | None:
        if not self.cluster:
            return next(iter(self._endpoints))
        ep = self._endpoint(self._rk(key))
        return ep.name if ep is not None else None

    def _scan_sizes(self, client: redis.Redis) -> dict[str, tuple[int, float | None]]:
        out: dict[str, tuple[int, float | None]] = {}
        batch: list[bytes] = []
        for rkey in client.scan_iter(match=_glob_escape(self._raw_prefix) + b"*", count=SCAN_BATCH):
            batch.append(rkey)
            if len(batch) == SCAN_BATCH:
                self._sizes(client, batch, out)
                batch = []
        if batch:
            self._sizes(client, batch, out)
        return out

    def _sizes(
        self, client: redis.Redis, rkeys: list[bytes], out: dict[str, tuple[int, float | None]]
    ) -> None:
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.strlen(rkey)
            pipe.pttl(rkey)
        replies = pipe.execute()
        now = time.monotonic()
        for rkey, size, pttl in zip(rkeys, replies[::2], replies[1::2], strict=True):
            if pttl == -2:  # gone since the SCAN
                continue
            try:
                key = rkey[len(self._raw_prefix) :].decode()
            except UnicodeDecodeError:
                continue
            out[key] = (size, now + pttl / 1000 if pttl >= 0 else None)

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
            self._warn(
                "maxmemory",
                "redis has no maxmemory: it grows until it is killed; set maxmemory and allkeys-lru",
            )
        elif not policy.startswith("allkeys-"):
            self._warn("policy", "redis maxmemory-policy is %s: puts fail when full; use allkeys-lru", policy)
        return int(info.get("maxmemory", 0))

    # ---- the Tier protocol ---------------------------------------------------------------------

    def get(self, key: str) -> Blob | None:
        rkey = self._rk(key)
        return self._seen(key, self._call(self._endpoint(rkey), lambda c: c.get(rkey)))

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        out: list[Blob | None] = [None] * len(keys)

        def fetch(ep: _Endpoint | None, idx: list[int]) -> None:
            rkeys = [self._rk(keys[i]) for i in idx]
            if self.cluster:
                values = self._call(ep, lambda c: _pipelined(c, [("get", rk) for rk in rkeys]))
            else:
                values = self._call(ep, lambda c: c.mget(rkeys))
            for j, i in enumerate(idx):
                out[i] = self._seen(keys[i], _FAIL if values is _FAIL else values[j])

        self._per_node(self._group(keys), fetch)
        return out

    def _per_node(
        self, groups: dict[_Endpoint | None, list[int]], work: Callable[[Any, list[int]], None]
    ) -> None:
        """work(endpoint, indices) for each group; Cluster primaries are asked concurrently."""
        if len(groups) <= 1 or self._closed:
            for ep, idx in groups.items():
                work(ep, idx)
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redis-tier")
        for f in [self._pool.submit(work, ep, idx) for ep, idx in groups.items()]:
            f.result()

    def _seen(self, key: str, value: Any) -> Blob | None:
        if value is _FAIL:
            return None
        if isinstance(value, Exception):
            self._count_error(type(value).__name__, "redis get %s: %s", key, value)
            if isinstance(value, AskError):
                self._refresh_topology()
            return None
        if value is None:
            self._forget(key, missed=True)
            return None
        known = self._index.get(key)
        if known is None or known[0] != len(value):
            self._remember(key, len(value), known[1] if known else None)
        return value

    def put(self, key: str, blob: Blob, ttl_s: float | None = None) -> list[str]:
        return self.put_many([(key, blob)], ttl_s)

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        px = _px(ttl_s)
        keys = [k for k, _ in items]
        values = [_value(blob) for _, blob in items]

        def store(ep: _Endpoint | None, idx: list[int]) -> None:
            fits = [i for i in idx if values[i][1] <= self.capacity]
            for i in set(idx) - set(fits):  # larger than the whole server: not stored, old blob gone
                self.delete(keys[i])
            if not fits:
                return
            cmds = [("set", self._rk(keys[i]), values[i][0], px) for i in fits]
            if len(cmds) == 1:
                res = self._call(ep, lambda c: [c.set(cmds[0][1], cmds[0][2], px=px)])
            else:
                res = self._call(ep, lambda c: _pipelined(c, cmds))
            for j, i in enumerate(fits):
                self._stored(keys[i], values[i][1], _FAIL if res is _FAIL else res[j], ttl_s)

        self._per_node(self._group(keys), store)
        return []  # the server evicts on its own; see the module docstring

    def _stored(self, key: str, size: int, reply: Any, ttl_s: float | None) -> None:
        if reply is _FAIL or isinstance(reply, Exception) or not reply:
            if isinstance(reply, Exception):
                self._count_error(type(reply).__name__, "redis put %s: %s", key, reply)
            self.stats.dropped_puts += 1
            return
        self._remember(key, size, time.monotonic() + ttl_s if ttl_s else None)

    def contains(self, key: str) -> bool:
        rkey = self._rk(key)
        return self._exists(key, self._call(self._endpoint(rkey), lambda c: c.exists(rkey)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` for each key in one round trip per server (pipelined EXISTS); down => False."""
        out = [False] * len(keys)

        def check(ep: _Endpoint | None, idx: list[int]) -> None:
            cmds = [("exists", self._rk(keys[i])) for i in idx]
            replies = self._call(ep, lambda c: _pipelined(c, cmds))
            for j, i in enumerate(idx):
                out[i] = self._exists(keys[i], _FAIL if replies is _FAIL else replies[j])

        self._per_node(self._group(keys), check)
        return out

    def _exists(self, key: str, reply: Any) -> bool:
        if reply is _FAIL:
            return False
        if isinstance(reply, Exception):
            self._count_error(type(reply).__name__, "redis exists %s: %s", key, reply)
            if isinstance(reply, AskError):
                self._refresh_topology()
            return False
        if not reply:
            self._forget(key, missed=True)
        return bool(reply)

    def delete(self, key: str) -> bool:
        rkey = self._rk(key)
        n = self._call(self._endpoint(rkey), lambda c: c.delete(rkey))
        if n is _FAIL:
            return False
        self._forget(key)
        return bool(n)

    def keys(self) -> Iterator[str]:
        """Our keys as the servers list them now (SCAN per primary; a primary that is down is skipped)."""
        match = _glob_escape(self._raw_prefix) + b"*"
        for ep in self._primaries():
            cursor = 0
            while True:
                page = self._call(ep, lambda c, cur=cursor: c.scan(cur, match=match, count=SCAN_BATCH))
                if page is _FAIL:
                    break
                cursor, rkeys = page
                for rkey in rkeys:
                    yield rkey[len(self._raw_prefix) :].decode(errors="replace")
                if cursor == 0:
                    break

    def close(self) -> None:
        self._closed = True  # a running reconcile stops at its next call
        if self._reconciler is not None and self._reconciler is not threading.current_thread():
            self._reconciler.join(timeout=self._socket_timeout_s * 2 + 1)
        for ep in list(self._endpoints.values()):
            ep.client.connection_pool.disconnect()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._rc is not None:
            self._rc.close()


def _pipelined(client: redis.Redis, cmds: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One round trip; per-command errors come back as exception objects."""
    pipe = client.pipeline(transaction=False)
    for cmd in cmds:
        if cmd[0] == "get":
            pipe.get(cmd[1])
        elif cmd[0] == "exists":
            pipe.exists(cmd[1])
        else:
            pipe.set(cmd[1], cmd[2], px=cmd[3])
    return pipe.execute(raise_on_error=False)


def _value(blob: Blob) -> tuple[bytes | memoryview, int]:
    """The blob as redis-py sends it without a copy, and its size in bytes."""
    if isinstance(blob, bytes):
        return blob, len(blob)
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv, mv.nbytes


def _px(ttl_s: float | None) -> int | None:
    if ttl_s is None:
        return None
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidArgument(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
    return max(1, math.ceil(ttl_s * 1000))


def _glob_escape(raw: bytes) -> bytes:
    for ch in (b"\\", b"*", b"?", b"[", b"]"):
        raw = raw.replace(ch, b"\\" + ch)
    return raw
