"""Every registered kind of tier passes the conformance suite (tests/kvstore/tier_conformance.py): cpu
(plain and arena memory), disk, redis standalone and Cluster against real Valkey, fs, gpu where CUDA
is present, and `sqlite`, a tier this module defines and registers itself (a real one: blobs in one
SQLite file that every process on the host shares, LRU by blob bytes, TTLs on the store's clock),
which passes the same suite without any other file knowing of it."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from kvstore.clock import Clock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.lru import check_ttl
from kvstore.settings import Size
from kvstore.tier_registry import TierContext, TierSpec, register_tier, tier_specs, unregister_tier
from kvstore.tiers.base import TOO_LARGE, TierStats, TierWriteError
from tests.kvstore.tier_conformance import CHECKS, SIZE, Harness, run

# -- a tier of this test's own ---------------------------------------------------------------------


class SqliteSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path
    capacity: Size = 64 << 20


class SqliteTier:
    """Blobs in one SQLite file (WAL), shared by every process on the host that opens it; LRU by a use
    counter, blob bytes within `capacity`; expiry times on the clock's wall time. Thread-safe."""

    def __init__(self, path: Path, capacity: int, clock: Clock) -> None:
        self.name, self.capacity, self.stats, self._clock = "sqlite", capacity, TierStats(), clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS blobs (key TEXT PRIMARY KEY, data BLOB NOT NULL, "
            "size INTEGER NOT NULL, expires REAL, used INTEGER NOT NULL)"
        )

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _live(self, db: sqlite3.Connection, key: str) -> tuple[bytes, float | None] | None:
        row = db.execute("SELECT data, expires FROM blobs WHERE key = ?", (key,)).fetchone()
        if row is not None and row[1] is not None and row[1] <= self._clock.time():
            db.execute("DELETE FROM blobs WHERE key = ?", (key,))
            self.stats.expired += 1
            return None
        return row

    def get(self, key: str) -> bytes | None:
        with self._tx() as db:
            row = self._live(db, key)
            if row is not None:
                db.execute("UPDATE blobs SET used = (SELECT MAX(used) + 1 FROM blobs) WHERE key = ?", (key,))
        return None if row is None else row[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def contains(self, key: str) -> bool:
        with self._tx() as db:
            return self._live(db, key) is not None

    def put(self, key: str, blob: Any, ttl_s: float | None = None) -> list[str]:
        check_ttl(ttl_s)
        data = bytes(blob)
        if len(data) > self.capacity:
            self.delete(key)
            raise TierWriteError(
                self.name, {key: TOO_LARGE}, f"blob of {len(data)} bytes is over its capacity"
            )
        expires = None if ttl_s is None else self._clock.time() + ttl_s
        evicted: list[str] = []
        with self._tx() as db:
            now = self._clock.time()
            self.stats.expired += db.execute("DELETE FROM blobs WHERE expires <= ?", (now,)).rowcount
            db.execute(
                "INSERT OR REPLACE INTO blobs VALUES (?, ?, ?, ?, (SELECT COALESCE(MAX(used), 0) + 1 FROM blobs))",
                (key, data, len(data), expires),
            )
            while db.execute("SELECT SUM(size) FROM blobs").fetchone()[0] > self.capacity:
                (oldest,) = db.execute("SELECT key FROM blobs ORDER BY used LIMIT 1").fetchone()
                db.execute("DELETE FROM blobs WHERE key = ?", (oldest,))
                evicted.append(oldest)
        self.stats.evictions += len(evicted)
        return evicted

    def put_many(self, items: Sequence[tuple[str, Any]], ttl_s: float | None = None) -> list[str]:
        check_ttl(ttl_s)
        evicted: list[str] = []
        failed: dict[str, str] = {}
        for k, b in items:
            try:
                evicted += self.put(k, b, ttl_s)
            except TierWriteError as e:
                failed.update(e.failed)
        if failed:
            raise TierWriteError(self.name, failed, "over its capacity", evicted=evicted)
        return evicted

    def delete(self, key: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM blobs WHERE key = ?", (key,)).rowcount > 0

    def keys(self) -> Iterator[str]:
        with self._tx() as db:
            rows = db.execute(
                "SELECT key FROM blobs WHERE expires IS NULL OR expires > ?", (self._clock.time(),)
            ).fetchall()
        return iter([r[0] for r in rows])

    def usage(self) -> int:
        with self._tx() as db:
            return db.execute("SELECT COALESCE(SUM(size), 0) FROM blobs").fetchone()[0]

    def __len__(self) -> int:
        with self._tx() as db:
            return db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


SQLITE = TierSpec(
    "sqlite",
    lambda ctx: SqliteTier(ctx.settings.path, ctx.settings.capacity, ctx.clock),
    shared=True,  # every process on this host that opens the file
    durable=True,
    medium="SQLITE",
    settings=SqliteSettings,
    help="blobs in one SQLite file",
)


@pytest.fixture
def sqlite_tier() -> Iterator[None]:
    register_tier(SQLITE)
    yield
    unregister_tier("sqlite")


# -- the harnesses ---------------------------------------------------------------------------------

KINDS = ["cpu", "cpu-arena", "disk", "redis", "redis-cluster", "fs", "gpu", "sqlite"]


def _fresh(tmp_path: Path) -> Path:
    d = tmp_path / uuid.uuid4().hex[:8]
    d.mkdir()
    return d


@contextlib.contextmanager
def fs_outage(block: dict[str, Any]) -> Iterator[None]:
    """The shared directory out of reach: every path under it fails (ENOTDIR), as a lost mount does."""
    root = Path(block["path"])
    away = root.with_name(root.name + ".away")
    root.rename(away)
    root.write_bytes(b"not a directory")
    try:
        yield
    finally:
        root.unlink()
        away.rename(root)


@pytest.fixture
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    kind: str = request.param
    state = tmp_path / "state"
    if kind == "cpu":
        h = Harness("cpu", lambda c: {"capacity": c, "memory": "plain"}, state)
    elif kind == "cpu-arena":
        h = Harness("cpu", lambda c: {"capacity": c, "memory": "arena"}, state)
    elif kind == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("the gpu tier needs CUDA")
        h = Harness("gpu", lambda c: {"capacity": c}, state)
    elif kind == "disk":
        h = Harness("disk", lambda c: {"capacity": c, "path": _fresh(tmp_path)}, state)
    elif kind == "redis":
        factory = request.getfixturevalue("valkey_factory")
        server = factory("--appendonly", "yes", "--appendfsync", "always", "--maxmemory", "2mb",
                         "--maxmemory-policy", "allkeys-lru")  # fmt: skip

        @contextlib.contextmanager
        def outage(block: dict[str, Any]) -> Iterator[None]:
            server.kill()
            try:
                yield
            finally:
                server.start()  # the AOF brings its blobs back

        prefix = f"cf{uuid.uuid4().hex[:6]}:"
        h = Harness("redis", lambda c: {"url": server.url, "prefix": prefix}, state, exact_capacity=False,
                    backend_capacity=2 << 20, clock_expiry=False, outage=outage)  # fmt: skip
    elif kind == "redis-cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        prefix = f"cf{uuid.uuid4().hex[:6]}:"
        block = {"url": cluster.urls, "prefix": prefix, "cluster": True}
        h = Harness("redis", lambda c: block, state, exact_capacity=False, clock_expiry=False,
                    no_outage="one Cluster primary down: test_redis_cluster.py, test_fleet_faults.py")  # fmt: skip
    elif kind == "fs":  # sweeps only when a check asks (test_fs_tier.py runs them)
        h = Harness("fs", lambda c: {"path": _fresh(tmp_path), "capacity": c, "sweep_interval": 3600}, state,
                    outage=fs_outage)  # fmt: skip
    else:
        request.getfixturevalue("sqlite_tier")
        h = Harness("sqlite", lambda c: {"path": _fresh(tmp_path) / "blobs.db", "capacity": c}, state,
                    no_outage="a file on this host")  # fmt: skip
    yield h
    h.close()


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("harness", KINDS, indirect=True)
def test_conformance(harness: Harness, check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run(harness, check, monkeypatch)


def test_every_registered_tier_is_in_the_suite() -> None:
    assert set(tier_specs()) <= {k.split("-")[0] for k in KINDS}


def test_a_registered_tier_is_a_store_setting_flag_and_block(sqlite_tier: None, tmp_path: Path) -> None:
    """The test's own tier is a setting like any built-in one: a block or flat settings, refused
    values named, a store built from it; unregistered, the name is unknown again."""
    flat = StoreConfig(tiers=["cpu", "sqlite"], sqlite_path=tmp_path / "a.db", sqlite_capacity="1MiB")
    assert flat.tier("sqlite").capacity == 1 << 20 and flat.sqlite_path == tmp_path / "a.db"
    block = StoreConfig(tiers=["sqlite"], sqlite={"path": str(tmp_path / "a.db")})
    assert block.tier("sqlite").capacity == 64 << 20
    with pytest.raises(ConfigError, match="sqlite_capacity: not a size"):
        StoreConfig(tiers=["sqlite"], sqlite={"path": "x", "capacity": "lots"})
    with pytest.raises(ConfigError, match="already"):
        register_tier(SQLITE)
    ctx = TierContext("sqlite", block.tier("sqlite"))
    tier = SQLITE.builder()(ctx)
    tier.put("0" * 32, b"x" * SIZE)
    assert tier.usage() == SIZE
    tier.close()
    unregister_tier("sqlite")
    with pytest.raises(ConfigError, match="unknown tier 'sqlite'"):
        StoreConfig(tiers=["sqlite"])
    register_tier(SQLITE)
