"""Every miss has a reason (kvstore/miss_log.py): the store tells evicted from expired from corrupt
from unreachable from never stored, per read and per prefix lookup, and counts them."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore.blob import encode_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.miss_log import MissLog
from kvstore.store import TieredStore
from tests.conftest import needs_valkey


def key(i: int) -> str:
    return f"{i:032x}"


def blob(seed: int, tokens: int = 64) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, tokens, 1, 16, generator=g).half())  # 8 KiB of payload


def reasons_of(store: TieredStore, keys: list[str]) -> list[str | None]:
    reasons: list[str | None] = []
    store.batch_get(keys, reasons)
    return reasons


def counted(store: TieredStore) -> dict[str, int]:
    return {k: v for k, v in store.stats()["miss_reasons"].items() if v}


def test_evicted_expired_deleted_and_never_stored(tmp_path: Path) -> None:
    size = len(blob(0))
    clock = ManualClock()
    with TieredStore(StoreConfig(tiers=["cpu"], cpu_capacity=3 * size, ttl=30), clock=clock) as store:
        for i in range(5):  # room for 3: keys 0 and 1 are evicted
            store.put_blob(key(i), blob(i))
        assert reasons_of(store, [key(i) for i in range(6)]) == [
            "evicted", "evicted", None, None, None, "not_stored",
        ]  # fmt: skip
        assert store.delete(key(4))
        assert store.get_blob(key(4)) is None  # deleted on purpose: as if never stored
        clock.advance(30)
        assert reasons_of(store, [key(2), key(3), key(4)]) == ["expired", "expired", "not_stored"]
        assert store.lookup([key(9), key(2)]) == (0, "not_stored")
        assert counted(store) == {"evicted": 2, "not_stored": 4, "expired": 2}
        assert store.metrics.value("kvstore_miss_reasons_total", reason="expired") == 2


def test_a_promotion_renews_the_ttl_it_reports(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers=["cpu", "disk"], disk_path=tmp_path / "d", ttl=50)
    clock = ManualClock()
    with TieredStore(cfg, clock=clock) as store:
        cpu, _ = store.tiers
        store.put_blob(key(1), blob(1))
        clock.advance(30)
        cpu.delete(key(1))
        assert store.get_blob(key(1)) is not None  # from disk, promoted into cpu with a fresh TTL
        clock.advance(30)  # the disk copy has expired, the promoted one has not
        cpu.delete(key(1))  # ... and is evicted
        assert store.lookup([key(1)]) == (0, "evicted")
        clock.advance(30)
        assert store.lookup([key(1)]) == (0, "expired")


def test_corrupt_copy_is_reported_on_this_read_and_later(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers=["disk"], disk_path=tmp_path / "d")
    with TieredStore(cfg) as store:
        store.put_blob(key(7), blob(7))
        (path,) = [p for p in (tmp_path / "d").rglob(f"{key(7)}*") if p.is_file()]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        reasons: list[str | None] = []
        assert store.get_blob(key(7), reasons) is None and reasons == ["corrupt"]
        assert store.lookup([key(7)]) == (0, "corrupt")  # deleted, and remembered why
        store.put_blob(key(7), blob(7))  # a good copy again
        assert store.lookup([key(7)]) == (1, None)


@needs_valkey
def test_a_dead_redis_tier_is_unreachable_not_a_plain_miss(valkey_factory) -> None:
    server = valkey_factory()
    cfg = StoreConfig(
        tiers=["cpu", "redis"], cpu_capacity=len(blob(0)), redis_url=server.url, redis_prefix="mr:"
    )
    with TieredStore(cfg) as store:
        store.put_blob(key(1), blob(1))
        store.put_blob(key(2), blob(2))  # key(1) now lives in redis only
        assert store.get_blob(key(1)) is not None  # from redis (and promoted: key(2) leaves cpu)
        server.kill()
        assert reasons_of(store, [key(2)]) == ["unreachable"]
        assert store.lookup([key(1), key(2)])[1] == "unreachable"
        assert counted(store)["unreachable"] == 2


def test_the_log_is_bounded_and_forgets_the_oldest() -> None:
    log = MissLog(capacity=2)
    log.written([key(1), key(2), key(3)], now=0.0)
    assert [log.reason(key(i), 1.0, None) for i in (1, 2, 3)] == ["not_stored", "evicted", "evicted"]
    log.corrupt(key(9))  # the log is full: an unknown key is not added
    assert log.reason(key(9), 1.0, None) == "not_stored"
    assert MissLog(capacity=0).reason(key(1), 0.0, None) == "not_stored"
