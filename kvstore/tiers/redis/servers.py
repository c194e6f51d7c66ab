"""How the redis tier reaches its servers: routing, redirects, calls behind circuit breakers.

- `RedisServers` owns the clients (one pool standalone; one client per primary in a Cluster), maps a
  key to the server that owns it (hash slot -> primary, cached until the topology changes) and runs
  calls that never raise: `call` returns `FAIL` when the server is down, in backoff or refuses.
- It follows the Cluster as a real client does (`call` and `pipeline`, once per command): `-ASK`
  (the slot is migrating and the key is already on the target) -> `ASKING` + the command on the
  target, the slot map unchanged; `-MOVED` (the slot has a new owner: a finished migration, a
  failover) -> that slot pointed at the new owner, the command sent there, the whole map refreshed
  in the background. A second redirect for the same command is an error (a miss, a failed write).
  While a primary is out of reach the map is refreshed in the background at most every 0.5 s, so a
  promoted replica is found without waiting for the breaker's backoff. Reads go to primaries only.
- Each server has a `Breaker` (kvstore/breaker.py): after a failure it is skipped without touching
  the network for a backoff that doubles from 0.1 s to 5 s (counted in `stats.extra["fast_fails"]`),
  then one caller probes it. redis-py's own retries are off: the breaker does the retrying and
  callers never wait.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, AuthenticationError, MovedError, RedisClusterException
from redis.retry import Retry

from kvstore.breaker import Breaker
from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError
from kvstore.tiers.base import TierStats
from kvstore.tiers.redis.commands import asking, pipelined, replicated
from kvstore.tiers.redis.connection import (
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    ZeroCopyConnection,
    ZeroCopySSLConnection,
    split_url,
)

log = logging.getLogger("kvstore.tiers.redis")  # the tier's warnings under one logger name

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
BACKEND_ERRORS = (redis.RedisError, RedisClusterException, OSError)
NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
FAIL = object()  # a call that did not reach the server (or that the server refused)
REFRESH_EVERY_S = 0.5  # background slot-map refreshes while a primary is out of reach, at most this often
# stats.extra counters of a Cluster client, exported to Prometheus by kvstore/metrics.py: redirects
# followed (ask, moved), slot-map refreshes, calls refused by a breaker without touching the network
CLUSTER_COUNTERS = ("ask", "moved", "map_refreshes", "fast_fails")


class Endpoint:
    """One server: its client and its breaker."""

    def __init__(self, name: str, client: redis.Redis, clock: Clock = SYSTEM) -> None:
        self.name, self.client, self.breaker = name, client, Breaker(BACKOFF_MIN_S, BACKOFF_MAX_S, clock)


class RedisServers:
    """The servers behind one URL. Thread-safe. Failures are counted in `stats`, logged once per
    outage, and `on_recovered()` runs when a server answers again after an outage."""

    def __init__(
        self,
        url: str,
        cluster: bool,
        stats: TierStats,
        on_recovered: Callable[[], None],
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        clock: Clock = SYSTEM,
    ) -> None:
        """`clock`: the breakers' (the store's); the slot map's refresh interval is real time."""
        self.url, self.cluster, self.stats = url, cluster, stats
        self.clock = clock
        self.socket_timeout_s = socket_timeout_s
        self.closed = False
        self.auth_error: Exception | None = None
        self._on_recovered = on_recovered
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # concurrent batches over Cluster primaries
        self._last_log: dict[str, float] = {}
        first_url, options, hosts = split_url(url)
        timeouts = dict(socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s)
        no_retry = Retry(NoBackoff(), 0)  # our breaker does the retrying; callers never wait
        tls = options.pop("connection_class", redis.Connection) is redis.SSLConnection
        self._endpoints: dict[str, Endpoint] = {}
        self._rc: RedisCluster | None = None
        self._slot_eps: dict[int, Endpoint] = {}  # hash slot -> its primary, until the topology changes
        self._refresher: threading.Thread | None = None
        self._refreshed_at = -math.inf
        if cluster:
            if options.get("db", 0) != 0:
                raise ConfigError("Redis Cluster has only db 0; drop the /db from redis_url")
            self._cluster_args = dict(
                url=first_url,
                startup_nodes=[ClusterNode(h, p) for h, p in hosts[1:]],
                retry=no_retry,
                **timeouts,
                **({} if tls else {"connection_class": ZeroCopyConnection}),
            )
            self._cluster_breaker = Breaker(BACKOFF_MIN_S, BACKOFF_MAX_S, clock)
            for counter in CLUSTER_COUNTERS:  # exported from the start (kvstore/metrics.py)
                stats.extra.setdefault(counter, 0)
        else:
            stats.extra.setdefault("fast_fails", 0)
            if len(hosts) != 1:
                raise ConfigError("several hosts in redis_url need redis_cluster: true")
            cls = ZeroCopySSLConnection if tls else ZeroCopyConnection
            pool = redis.ConnectionPool(connection_class=cls, retry=no_retry, **timeouts, **options)
            name = "{}:{}".format(*hosts[0])
            self._endpoints[name] = Endpoint(name, redis.Redis(connection_pool=pool), clock)

    # ---- routing --------------------------------------------------------------------------------

    def _cluster_client(self) -> RedisCluster | None:
        if self._rc is not None:
            return self._rc
        if not self._cluster_breaker.allow():
            return None
        try:
            self._rc = RedisCluster(**self._cluster_args)
        except BACKEND_ERRORS as e:
            if isinstance(e, AuthenticationError):
                self.auth_error = e
            self.stats.errors += 1
            self._cluster_breaker.failure()
            self.warn("cluster", "redis cluster %s unreachable: %s", self.url, e)
            return None
        self._cluster_breaker.success()
        return self._rc

    def _endpoint_named(self, host: str, port: int, client: redis.Redis) -> Endpoint:
        name = f"{host}:{port}"
        ep = self._endpoints.get(name)
        if ep is None or ep.client is not client:
            ep = self._endpoints[name] = Endpoint(name, client, self.clock)
        return ep

    def endpoint(self, rkey: bytes) -> Endpoint | None:
        """The server that owns `rkey`; None when the Cluster cannot be reached to ask."""
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
        except BACKEND_ERRORS:
            return None
        ep = self._slot_eps[slot] = self._endpoint_named(node.host, node.port, rc.get_redis_connection(node))
        return ep

    def owner(self, rkey: bytes) -> str | None:
        """The name of the server that owns `rkey`."""
        if not self.cluster:
            return next(iter(self._endpoints))
        ep = self.endpoint(rkey)
        return ep.name if ep is not None else None

    def primaries(self) -> list[Endpoint]:
        if not self.cluster:
            return list(self._endpoints.values())
        rc = self._cluster_client()
        if rc is None:
            return []
        return [self._endpoint_named(n.host, n.port, rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def group(self, rkeys: Sequence[bytes]) -> dict[Endpoint | None, list[int]]:
        """Indices of `rkeys` by the server that owns them."""
        groups: dict[Endpoint | None, list[int]] = {}
        for i, rkey in enumerate(rkeys):
            groups.setdefault(self.endpoint(rkey), []).append(i)
        return groups

    def refresh_topology(self) -> None:
        """Ask the Cluster for its slot map now; the cached slot -> primary entries are dropped after
        it answered (dropped before, calls made meanwhile would cache the old map again)."""
        self._refreshed_at = time.monotonic()
        self.stats.extra["map_refreshes"] = self.stats.extra.get("map_refreshes", 0) + 1
        if self._rc is not None:
            try:
                self._rc.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
            except BACKEND_ERRORS as e:
                log.debug("cluster topology refresh failed: %s", e)
        self._slot_eps = {}

    def refresh_soon(self, min_interval_s: float = 0.0) -> None:
        """`refresh_topology` in a background thread (one at a time; none when the last one began less
        than `min_interval_s` ago): a node that hangs must not hold a caller for its socket timeout."""
        if not self.cluster or self.closed or time.monotonic() - self._refreshed_at < min_interval_s:
            return
        with self._lock:
            if self._refresher is not None and self._refresher.is_alive():
                return
            self._refreshed_at = time.monotonic()
            self._refresher = threading.Thread(
                target=self.refresh_topology, name="redis-tier-topology", daemon=True
            )
            self._refresher.start()

    def _node(self, host: str, port: int) -> Endpoint | None:
        """The endpoint of a node a redirect named (known or not yet)."""
        ep = self._endpoints.get(f"{host}:{port}")
        if ep is not None:
            return ep
        rc = self._cluster_client()
        if rc is None:
            return None
        try:
            client = rc.get_redis_connection(rc.get_node(host, port) or ClusterNode(host, port))
        except BACKEND_ERRORS:
            return None
        return self._endpoint_named(host, port, client)

    def _follow(self, e: AskError) -> Endpoint | None:
        """Where a redirect sends its command. MOVED: the slot is the target's from now on (the rest
        of the map is refreshed in the background); ASK: for this command only."""
        target = self._node(e.host, e.port)
        kind = "moved" if isinstance(e, MovedError) else "ask"
        self.stats.extra[kind] = self.stats.extra.get(kind, 0) + 1
        if kind == "moved":
            if target is not None:
                self._slot_eps[e.slot_id] = target
            self.refresh_soon()
        return target

    # ---- calls ----------------------------------------------------------------------------------

    def call(self, ep: Endpoint | None, fn: Callable[[redis.Redis], Any]) -> Any:
        """fn(client), or FAIL (counted, logged) when the server is down, in backoff or refuses. A
        MOVED/ASK raised by fn (one command) is followed once."""
        result = self._attempt(ep, fn)
        if isinstance(result, AskError):
            ask = not isinstance(result, MovedError)
            result = self._attempt(self._follow(result), (lambda c: asking(c, fn)) if ask else fn)
            if isinstance(result, AskError):
                self.count_error("moved", "redis: redirected twice (%s); refreshing the slot map", result)
                self.refresh_soon()
                return FAIL
        return result

    def pipeline(
        self, ep: Endpoint | None, cmds: Sequence[tuple[Any, ...]], wait: tuple[int, int] | None = None
    ) -> Any:
        """`pipelined(cmds)` on ep (FAIL when it is out of reach); each command answered by MOVED/ASK is
        sent once more where it was sent (ASKING before each ASK'd one), grouped by target. A command
        whose second server is out of reach answers a ConnectionError. `wait` (replicas, ms): each
        pipeline ends with WAIT; where fewer replicas acknowledged in time, its writes answer an error."""
        extra = [("wait", *wait)] if wait else []
        replies = self.call(ep, lambda c: pipelined(c, [*cmds, *extra]))
        if replies is FAIL:
            return FAIL
        if wait:
            replies = replicated(replies, wait)
        redirects: dict[tuple[bool, Endpoint | None], list[int]] = {}
        for i, reply in enumerate(replies):
            if isinstance(reply, AskError):
                moved = isinstance(reply, MovedError)
                redirects.setdefault((moved, self._follow(reply)), []).append(i)
        for (moved, target), idx in redirects.items():
            again = [cmds[i] for i in idx] if moved else [c for i in idx for c in (("asking",), cmds[i])]
            res = self.call(target, lambda c, again=[*again, *extra]: pipelined(c, again))
            if res is not FAIL and wait:
                res = replicated(res, wait)
            if res is not FAIL and not moved:
                res = res[1::2]
            for j, i in enumerate(idx):
                replies[i] = (
                    redis.ConnectionError(f"{target.name if target else '?'} unreachable")
                    if res is FAIL
                    else res[j]
                )
        return replies

    def _attempt(self, ep: Endpoint | None, fn: Callable[[redis.Redis], Any]) -> Any:
        """fn(ep.client) behind ep's breaker; FAIL, or the AskError/MovedError fn raised (to follow)."""
        if ep is None or self.closed:
            return FAIL
        if not ep.breaker.allow():
            self.stats.extra["fast_fails"] = self.stats.extra.get("fast_fails", 0) + 1
            self.refresh_soon(REFRESH_EVERY_S)  # a failover may have promoted a replica meanwhile
            return FAIL
        try:
            result = fn(ep.client)
        except AskError as e:  # MOVED/ASK: the caller follows it
            return e
        except NETWORK_ERRORS as e:
            if isinstance(e, AuthenticationError):
                self.auth_error = e
            self.stats.errors += 1
            if ep.breaker.failure():
                log.warning(
                    "redis %s is down (%s: %s); failing fast and retrying with backoff",
                    ep.name,
                    type(e).__name__,
                    e,
                )
            ep.client.connection_pool.disconnect(inuse_connections=False)
            self.refresh_soon()
            return FAIL
        except BACKEND_ERRORS as e:
            self.count_error(type(e).__name__, "redis %s: %s: %s", ep.name, type(e).__name__, e)
            return FAIL
        if ep.breaker.success():
            log.warning("redis %s is back", ep.name)
            self._on_recovered()
        return result

    def per_node(
        self, groups: dict[Endpoint | None, list[int]], work: Callable[[Any, list[int]], None]
    ) -> None:
        """work(endpoint, indices) for each group; Cluster primaries are asked concurrently."""
        if len(groups) <= 1 or self.closed:
            for ep, idx in groups.items():
                work(ep, idx)
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redis-tier")
        for f in [self._pool.submit(work, ep, idx) for ep, idx in groups.items()]:
            f.result()

    def count_error(self, kind: str, msg: str, *args: object) -> None:
        self.stats.errors += 1
        self.warn(kind, msg, *args)

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """log.warning, at most once per 10 s per kind."""
        now = time.monotonic()
        if now - self._last_log.get(kind, -math.inf) >= 10.0:
            self._last_log[kind] = now
            log.warning(msg, *args)

    def close(self) -> None:
        """Disconnect everything. Set `closed` (calls fail fast) earlier to stop users first."""
        self.closed = True
        if self._refresher is not None:
            self._refresher.join(timeout=self.socket_timeout_s * 2 + 1)
        for ep in list(self._endpoints.values()):
            ep.client.connection_pool.disconnect()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._rc is not None:
            self._rc.close()
