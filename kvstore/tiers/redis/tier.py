"""The redis tier: blobs in Redis or Valkey, standalone or Cluster (docs/design.md §4, §10, §11).

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
- Faults: a get while a server is down is a miss; a put it did not store raises TierWriteError
  naming the keys and why (counted in `stats.errors`, `stats.dropped_puts`); errors are logged once
  per outage.
- Consistency through an outage (hinted handoff, handoff.py): a delete, or a put replacing a
  blob the servers may hold (as far as this process knows: its index), that cannot reach its server
  invalidates the key: reads treat it as a miss until a replayer has deleted it on the server, so the
  older blob is never served. At most `max_invalidated` keys wait; beyond that the put or delete
  raises with the key in `stale`, and the store fails the request (503) instead of acknowledging it.
  `handoff_dir` keeps them through a restart (kvstore/tiers/handoff/journal.py: fsync'd before the
  request is acknowledged, replayed on start); a store built from its config always has one (under
  `state_dir`, kvstore.tier_registry.TierContext.handoff_dir); without it they live in this process only. Each server (each Cluster primary) has a
  circuit breaker: after a failure it is skipped without touching the network for a backoff that
  doubles from 0.1 s to 5 s (those calls count in `stats.extra["fast_fails"]`), then one caller
  probes it; the tier reconnects on its own. Timeouts: connect 0.5 s, each socket operation 2 s.
- Speed: values are sent as they are (redis-py's hiredis packer copies each one) and hiredis' replies
  are returned as they are; a batch is one MGET (standalone) or one pipeline per primary, the
  primaries asked concurrently (Cluster). `contains_many` is one pipeline of EXISTS per server, so a
  prefix lookup through the store costs one round trip, not one per key.
- Files (the package kvstore/tiers/redis/): this one is the Tier protocol; `connection.py` the URLs
  and zero-copy connections; `servers.py` reaches the servers (routing, redirects, a circuit breaker
  per server from kvstore/breaker.py); `commands.py` the commands and values sent; `index.py` keeps
  the byte accounting; the invalidations are kvstore/tiers/handoff/ (shared with every tier that
  declares hinted handoff).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import AskError

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError
from kvstore.protocol import Blob
from kvstore.tiers.base import BACKEND_ERROR, TOO_LARGE, UNAVAILABLE, TierStats, TierWriteError
from kvstore.tiers.handoff import Handoff, Journal
from kvstore.tiers.redis.commands import as_value, px_of, server_info
from kvstore.tiers.redis.connection import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S
from kvstore.tiers.redis.index import SCAN_BATCH, KeyIndex, Sizes, glob_escape, scan_sizes
from kvstore.tiers.redis.servers import BACKEND_ERRORS, FAIL, Endpoint, RedisServers

log = logging.getLogger("kvstore.tiers.redis")  # the tier's warnings under one logger name

UNBOUNDED = sys.maxsize
MAX_INVALIDATED = 100_000  # ~10 MiB of keys; the store fails deletes/replaces beyond it until replayed
WAIT_MS = 1000  # how long a put waits for its replicas (wait_replicas), below the socket timeout


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
        max_invalidated: int = MAX_INVALIDATED,
        handoff_dir: str | Path | None = None,
        wait_replicas: int = 0,
        clock: Clock = SYSTEM,
    ) -> None:
        """`server_maxmemory`: CONFIG SET maxmemory (+ allkeys-lru) on every primary at each connect,
        for deployments that own their Redis (tests, benchmarks); None leaves the server as it is.
        `max_invalidated`: keys an outage may leave to delete later (the hinted handoff's bound).
        `handoff_dir`: where those keys survive a restart (None: in this process's memory only).
        `wait_replicas`: a put counts as stored only once this many replicas of its primary have it
        (WAIT, up to WAIT_MS); 0: once the primary has it (replication is asynchronous: a failover may
        lose it). `clock`: the store's; the circuit breakers' backoffs and the expiries the byte
        accounting expects are on it (Redis itself expires keys by its own clock)."""
        self.url, self.prefix, self.cluster = url, prefix, cluster
        self._raw_prefix = prefix.encode()
        self.server_maxmemory = server_maxmemory
        self.wait_replicas = wait_replicas
        self.capacity = UNBOUNDED
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._clock = clock
        self._index = KeyIndex(self.stats, clock)
        self._reconciling = False
        self._reconciler: threading.Thread | None = None
        journal = (
            Journal(handoff_dir) if handoff_dir is not None else None
        )  # (ConfigError: nothing opened yet)
        self._servers = RedisServers(
            url,
            cluster,
            self.stats,
            self._reconcile_in_background,
            connect_timeout_s,
            socket_timeout_s,
            clock,
        )
        self._invalid = Handoff(
            max_invalidated, self._delete_on_servers, f"redis tier {prefix!r}", self.stats, journal
        )
        self.reconcile()
        if self._servers.auth_error is not None:
            self.close()
            raise ConfigError(f"redis at {url!r} refused our credentials: {self._servers.auth_error}")

    # ---- keys ----------------------------------------------------------------------------------

    def _rk(self, key: str) -> bytes:
        return self._raw_prefix + key.encode()

    def _group(self, keys: Sequence[str]) -> dict[Endpoint | None, list[int]]:
        return self._servers.group([self._rk(k) for k in keys])

    def _valid_groups(self, keys: Sequence[str]) -> dict[Endpoint | None, list[int]]:
        """`_group` without the invalidated keys (reads skip them: they are misses)."""
        if not len(self._invalid):
            return self._group(keys)
        idx = [i for i, k in enumerate(keys) if k not in self._invalid]
        groups = self._servers.group([self._rk(keys[i]) for i in idx])
        return {ep: [idx[j] for j in js] for ep, js in groups.items()}

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
        primaries = self._servers.primaries()
        try:
            for ep in primaries:
                part = self._servers.call(ep, lambda c: scan_sizes(c, self._raw_prefix, self._clock))
                info = self._servers.call(ep, self._server_info) if part is not FAIL else FAIL
                if part is FAIL or info is FAIL:
                    continue
                scanned.add(ep.name)
                found.update(part)
                maxmemory.append(info)
        finally:
            for key in [k for k in found if k in self._invalid]:  # deleted on the servers soon
                del found[key]
            self._index.finish_rebuild(found, scanned, self._owner)
        self._index.complete = self._index.complete or (bool(primaries) and len(scanned) == len(primaries))
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
        return server_info(client, self.stats, self.server_maxmemory, self._servers.warn)

    # ---- the Tier protocol ---------------------------------------------------------------------

    def get(self, key: str) -> Blob | None:
        if key in self._invalid:  # an older blob may still be there: never serve it
            return None
        rkey = self._rk(key)
        return self._seen(key, self._servers.call(self._servers.endpoint(rkey), lambda c: c.get(rkey)))

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        out: list[Blob | None] = [None] * len(keys)

        def fetch(ep: Endpoint | None, idx: list[int]) -> None:
            rkeys = [self._rk(keys[i]) for i in idx]
            if self.cluster:
                values = self._servers.pipeline(ep, [("get", rk) for rk in rkeys])
            else:
                values = self._servers.call(ep, lambda c: c.mget(rkeys))
            for j, i in enumerate(idx):
                out[i] = self._seen(keys[i], FAIL if values is FAIL else values[j])

        self._servers.per_node(self._valid_groups(keys), fetch)
        return out

    def _failed(self, op: str, key: str, reply: Any) -> bool:
        """True for a reply that carries no answer (server down, or an error, counted here)."""
        if reply is FAIL:
            return True
        if isinstance(reply, Exception):
            self._servers.count_error(type(reply).__name__, f"redis {op} %s: %s", key, reply)
            if isinstance(reply, AskError):
                self._servers.refresh_soon()
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
        """SET each blob; raises TierWriteError for those not stored. Returns [] (Redis evicts on its
        own; see the module docstring)."""
        px = px_of(ttl_s)
        keys = [k for k, _ in items]
        values = [as_value(blob) for _, blob in items]
        failed: dict[str, str] = {}
        details: dict[str, str] = {}  # reason -> what happened
        # keys waiting for a replayed DEL: this SET must not cross it on the wire, and clears it
        gens = (
            {k: g for k in keys if (g := self._invalid.generation(k)) is not None}
            if len(self._invalid)
            else {}
        )

        def store(ep: Endpoint | None, idx: list[int]) -> None:
            fits = [i for i in idx if values[i][1] <= self.capacity]
            for i in set(idx) - set(fits):  # larger than the whole server: not stored, old blob gone
                self.delete(keys[i])
                failed[keys[i]] = TOO_LARGE
                details[TOO_LARGE] = f"blob of {values[i][1]} bytes is over the server's maxmemory"
            if not fits:
                return
            cmds = [("set", self._rk(keys[i]), values[i][0], px) for i in fits]
            if self.wait_replicas:
                res = self._servers.pipeline(ep, cmds, wait=(self.wait_replicas, WAIT_MS))
            elif len(cmds) == 1:
                res = self._servers.call(ep, lambda c: [c.set(cmds[0][1], cmds[0][2], px=px)])
            else:
                res = self._servers.pipeline(ep, cmds)
            for j, i in enumerate(fits):
                why = self._stored(keys[i], values[i][1], FAIL if res is FAIL else res[j], ttl_s, ep)
                if why is not None:
                    failed[keys[i]], details[why[0]] = why

        with self._invalid.replay_lock if gens else contextlib.nullcontext():
            self._servers.per_node(self._group(keys), store)
        self._invalid.discard_many((k, g) for k, g in gens.items() if k not in failed)
        if failed:
            # An older blob of a key we could not replace must not be served: invalidate it (or, with
            # no room left to remember it, say so: the store fails the put)
            stale = self._invalidate([k for k, why in failed.items() if why != TOO_LARGE])
            raise TierWriteError(self.name, failed, "; ".join(details.values()), stale)
        return []

    def _may_hold(self, key: str) -> bool:
        """Whether the servers may hold a blob of `key`, as far as this process knows (its index;
        anything, before a scan of every server has completed)."""
        return not self._index.complete or self._index.get(key) is not None

    def _invalidate(self, keys: list[str]) -> list[str]:
        """Hand `keys` off to the replayer (those the servers may hold); returns those that did not fit.
        Those stay in the index: the servers may still hold them, so a retried delete or a later put
        of such a key must fail again rather than take it for absent."""
        held = [k for k in keys if self._may_hold(k)]
        overflow = self._invalid.add(held) if held else []
        for key in set(held) - set(overflow):
            self._index.forget(key)
        return overflow

    def _delete_on_servers(self, keys: list[str]) -> set[str]:
        """DEL `keys` (one pipeline per server); the keys whose DEL the server confirmed."""
        done: set[str] = set()

        def work(ep: Endpoint | None, idx: list[int]) -> None:
            replies = self._servers.pipeline(ep, [("delete", self._rk(keys[i])) for i in idx])
            if replies is not FAIL:
                done.update(
                    keys[i] for i, r in zip(idx, replies, strict=True) if not isinstance(r, Exception)
                )

        self._servers.per_node(self._group(keys), work)
        for key in done:
            self._index.forget(key)
        return done

    def _stored(
        self, key: str, size: int, reply: Any, ttl_s: float | None, ep: Endpoint | None
    ) -> tuple[str, str] | None:
        """Book a SET reply; (reason, detail) when it did not store the blob."""
        if reply is FAIL or isinstance(reply, Exception) or not reply:
            self.stats.dropped_puts += 1
            if isinstance(reply, Exception):
                self._servers.count_error(type(reply).__name__, "redis put %s: %s", key, reply)
                return BACKEND_ERROR, f"{type(reply).__name__}: {str(reply)[:200]}"
            where = ep.name if ep is not None else self.url
            return UNAVAILABLE, f"{where} is unreachable (down, hung or in backoff)"
        self._index.remember(key, size, self._clock.monotonic() + ttl_s if ttl_s else None)
        return None

    def contains(self, key: str) -> bool:
        if key in self._invalid:
            return False
        rkey = self._rk(key)
        return self._exists(key, self._servers.call(self._servers.endpoint(rkey), lambda c: c.exists(rkey)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` for each key in one round trip per server (pipelined EXISTS); down => False."""
        out = [False] * len(keys)

        def check(ep: Endpoint | None, idx: list[int]) -> None:
            cmds = [("exists", self._rk(keys[i])) for i in idx]
            replies = self._servers.pipeline(ep, cmds)
            for j, i in enumerate(idx):
                out[i] = self._exists(keys[i], FAIL if replies is FAIL else replies[j])

        self._servers.per_node(self._valid_groups(keys), check)
        return out

    def _exists(self, key: str, reply: Any) -> bool:
        if self._failed("exists", key, reply):
            return False
        if not reply:
            self._index.forget(key, missed=True)
        return bool(reply)

    def delete(self, key: str) -> bool:
        """DEL, or (servers out of reach) invalidate the key until the replayer can DEL it."""
        rkey = self._rk(key)
        gen = self._invalid.generation(key)
        with self._invalid.replay_lock if gen is not None else contextlib.nullcontext():
            n = self._servers.call(self._servers.endpoint(rkey), lambda c: c.delete(rkey))
        if n is FAIL:
            if not self._may_hold(key):
                return False
            if self._invalidate([key]):
                detail = f"cannot delete {key}: {self.url} is unreachable and {self._invalid.limit} keys wait"
                raise TierWriteError(self.name, {}, detail, stale=[key])
            return True
        self._index.forget(key)
        if gen is not None:
            self._invalid.discard(key, gen)
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
                    key = rkey[len(self._raw_prefix) :].decode(errors="replace")
                    if key not in self._invalid:
                        yield key
                if cursor == 0:
                    break

    def close(self) -> None:
        self._invalid.close(timeout=self._servers.socket_timeout_s * 2 + 1)
        self._servers.closed = True  # a running reconcile stops at its next call
        if self._reconciler is not None and self._reconciler is not threading.current_thread():
            self._reconciler.join(timeout=self._servers.socket_timeout_s * 2 + 1)
        self._servers.close()
