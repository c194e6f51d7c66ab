"""The tiered store over real cpu and disk tiers: lookup order, promotion, write policies, admission,
TTL, corruption, lookup_prefix, validation and metrics."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from kvstore.blob import encode_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, CorruptBlob, InvalidArgument, InvalidKey, TooLarge
from kvstore.protocol import Blob
from kvstore.store import TieredStore
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from tests.blobs import kept


def key(i: int) -> str:
    return f"{i:032x}"


def blob(seed: int, tokens: int = 4, key: str | None = None) -> bytes:
    """Bound to no key unless `key` is given: the store keeps it bound to its key (tests.blobs.kept)."""
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, tokens, 1, 16, generator=g).half(), key=key)


class GatedTier(CpuTier):
    """A cpu tier whose writes wait for a gate: stands in for a slow lower tier."""

    def __init__(self, capacity: int, name: str) -> None:
        super().__init__(capacity, name=name)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        self.entered.set()
        assert self.gate.wait(30)
        return super().put_many(items, ttl_s)


def make_store(tmp_path: Path, **config: object) -> TieredStore:
    cfg = StoreConfig(tiers=["cpu", "disk"], disk_path=tmp_path / "disk", cpu_capacity=1 << 20, **config)
    return TieredStore(cfg)


@pytest.fixture
def store(tmp_path: Path) -> TieredStore:
    with make_store(tmp_path) as s:
        yield s


def value(s: TieredStore, name: str, **labels: str) -> float:
    return s.registry.get_sample_value(name, labels) or 0.0


def test_write_through_lookup_and_promotion(store: TieredStore) -> None:
    cpu, disk = store.tiers
    b = kept(blob(0), key(0))  # what the store keeps of blob(0), bound to key(0)
    store.put_blob(key(0), blob(0))
    assert cpu.contains(key(0)) and disk.contains(key(0))
    assert store.get_blob(key(0)) == b
    assert value(store, "kvstore_hits_total", tier="cpu") == 1
    cpu.delete(key(0))
    assert store.get_blob(key(0)) == b  # from disk ...
    assert value(store, "kvstore_hits_total", tier="disk") == 1
    assert value(store, "kvstore_tier_misses_total", tier="cpu") == 1
    assert cpu.contains(key(0))  # ... and promoted
    assert store.get_blob(key(0)) == b
    assert value(store, "kvstore_hits_total", tier="cpu") == 2
    assert store.get_blob(key(1)) is None
    assert value(store, "kvstore_misses_total") == 1
    assert store.exists(key(0)) and not store.exists(key(1))
    assert store.delete(key(0)) and not store.delete(key(0))
    assert not cpu.contains(key(0)) and not disk.contains(key(0))


def test_put_validates_before_storing(store: TieredStore) -> None:
    with pytest.raises(InvalidKey):
        store.put_blob("not-a-key", blob(0))
    with pytest.raises(InvalidKey):
        store.get_blob("AB" * 16)
    with pytest.raises(CorruptBlob):
        store.put_blob(key(1), b"garbage" * 20)
    bad = bytearray(blob(2))
    bad[-1] ^= 1
    with pytest.raises(CorruptBlob):
        store.put_blob(key(2), bad)
    with pytest.raises(InvalidArgument):
        store.put_blob(key(3), "a string")  # type: ignore[arg-type]
    with pytest.raises(CorruptBlob):  # one bad item: nothing of the batch is stored
        store.batch_put([(key(4), blob(4)), (key(5), b"junk")])
    assert not any(store.batch_exists([key(i) for i in range(6)]))
    assert all(t.usage() == 0 for t in store.tiers)


def test_blob_size_limit(tmp_path: Path) -> None:
    b = blob(0, tokens=64)
    with make_store(tmp_path, max_blob_size=len(b) - 1) as s:
        with pytest.raises(TooLarge):
            s.put_blob(key(0), b)
        s.put_blob(key(1), blob(1))
        assert not s.exists(key(0)) and s.exists(key(1))


def test_batches_keep_order(store: TieredStore) -> None:
    store.batch_put([(key(i), blob(i)) for i in (0, 2, 3)])
    store.tiers[0].delete(key(2))  # one of them only on disk
    got = store.batch_get([key(3), key(1), key(2), key(0)])
    assert got == [kept(blob(3), key(3)), None, kept(blob(2), key(2)), kept(blob(0), key(0))]
    assert store.batch_exists([key(0), key(1), key(2)]) == [True, False, True]
    assert store.tiers[0].contains(key(2))  # batch hits are promoted too


def test_lookup_prefix_stops_at_the_first_gap(store: TieredStore) -> None:
    cpu, disk = store.tiers
    keys = [key(i) for i in range(6)]
    for i in (0, 1, 2, 4, 5):
        store.put_blob(keys[i], blob(i))
    assert store.lookup_prefix(keys) == 3
    assert store.lookup_prefix(keys[3:]) == 0
    assert store.lookup_prefix(keys[4:]) == 2
    assert store.lookup_prefix([]) == 0
    cpu.delete(keys[1])  # present in a lower tier only: still counts
    disk.delete(keys[0])
    assert store.lookup_prefix(keys) == 3
    store.delete(keys[1])
    assert store.lookup_prefix(keys) == 1


def test_lookup_prefix_batches_through_contains_many() -> None:
    class BatchingTier(CpuTier):
        """A tier with one-round-trip membership, as a remote tier would offer."""

        calls = 0

        def contains_many(self, keys: Sequence[str]) -> list[bool]:
            self.calls += 1
            return [self.contains(k) for k in keys]

    lower = BatchingTier(1 << 20, name="lower")
    with TieredStore(StoreConfig(), [CpuTier(1 << 20), lower]) as s:
        keys = [key(i) for i in range(6)]
        for i in (0, 1, 2, 4):
            s.put_blob(keys[i], blob(i))
        s.tiers[0].delete(keys[1])
        assert s.lookup_prefix(keys) == 3 and lower.calls == 1
        assert s.batch_exists(keys) == [True, True, True, False, True, False] and lower.calls == 2


def test_write_back_reaches_lower_tiers_on_flush(tmp_path: Path) -> None:
    with make_store(tmp_path, write_policy="back") as s:
        s.batch_put([(key(i), blob(i)) for i in range(20)])
        assert all(s.tiers[0].contains(key(i)) for i in range(20))
        s.flush()
        assert all(s.tiers[1].contains(key(i)) for i in range(20))
        assert s.stats()["write_back_queued"] == 0


def test_write_back_never_blocks_and_counts_drops(tmp_path: Path) -> None:
    slow = GatedTier(1 << 20, name="slow")
    s = TieredStore(StoreConfig(write_policy="back", write_back_queue=2), [CpuTier(1 << 20), slow])
    try:
        s.put_blob(key(0), blob(0))
        assert slow.entered.wait(10)  # the writer holds key 0 and waits at the gate
        putter = threading.Thread(target=lambda: [s.put_blob(key(i), blob(i)) for i in range(1, 10)])
        putter.start()
        putter.join(timeout=20)
        assert not putter.is_alive(), "put blocked on a slow lower tier"
        s.delete(key(2))  # queued, then deleted: must never reach the lower tier
        s.delete(key(0))  # deleted while being written (without waiting for that write)
        assert (
            value(s, "kvstore_dropped_writes_total", tier="slow", reason="queue_full") == 7
        )  # 1 in flight, 2 queued
        slow.gate.set()
        s.flush()
        assert sorted(slow.keys()) == [key(1)]
        assert all(s.tiers[0].contains(key(i)) for i in range(10) if i not in (0, 2))
        assert s.stats()["tiers"][1]["dropped_writes"] == 7
    finally:
        slow.gate.set()
        s.close()


def test_admission_after_n_hits(tmp_path: Path) -> None:
    with make_store(tmp_path, admission_hits=2) as s:
        cpu, disk = s.tiers
        s.put_blob(key(0), blob(0))
        s.put_blob(key(1), blob(1))
        assert cpu.contains(key(0)) and not disk.contains(key(0))
        s.get_blob(key(0))
        assert not disk.contains(key(0))
        s.get_blob(key(0))
        assert disk.contains(key(0))  # second hit: admitted
        assert not disk.contains(key(1))
        cpu.delete(key(1))  # lost from the top tier before admission: gone
        assert s.get_blob(key(1)) is None
        cpu.delete(key(0))
        assert s.get_blob(key(0)) == kept(blob(0), key(0))  # admitted blobs survive in the lower tier


def test_ttl_expires_in_every_tier(tmp_path: Path) -> None:
    clock = ManualClock()
    config = StoreConfig(tiers=["cpu", "disk"], cpu_capacity="1MiB", disk_path=tmp_path / "d", ttl=30)
    with TieredStore(config, clock=clock) as s:  # the store's clock is its tiers' too
        s.put_blob(key(0), blob(0))
        clock.advance(29.9)
        assert s.get_blob(key(0)) == kept(blob(0), key(0))
        clock.advance(0.2)
        assert s.get_blob(key(0)) is None
        assert not s.exists(key(0)) and all(len(t) == 0 for t in s.tiers)
        assert s.stats()["tiers"][1]["expired"] == 1


def test_corrupt_blob_in_a_lower_tier_is_a_counted_miss_and_is_deleted(store: TieredStore) -> None:
    cpu, disk = store.tiers
    store.put_blob(key(0), blob(0))
    cpu.delete(key(0))
    path = next((store.config.disk_path).glob(f"??/??/{key(0)}"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # bit rot on disk
    path.write_bytes(data)
    assert store.get_blob(key(0)) is None
    assert value(store, "kvstore_corrupt_blobs_total", tier="disk") == 1
    assert value(store, "kvstore_misses_total") == 1
    assert not disk.contains(key(0)) and not path.exists() and not cpu.contains(key(0))


def test_corrupt_blob_in_the_top_tier_falls_through_to_a_good_copy(tmp_path: Path) -> None:
    top, low = DiskTier(tmp_path / "top", 1 << 20, "top"), DiskTier(tmp_path / "low", 1 << 20)
    with TieredStore(StoreConfig(), [top, low]) as s:
        s.put_blob(key(0), blob(0))
        bad = bytearray(blob(0))
        bad[60] ^= 1
        top.put(key(0), bytes(bad))  # corrupted behind the store's back
        assert s.get_blob(key(0)) == kept(blob(0), key(0))
        assert value(s, "kvstore_corrupt_blobs_total", tier="top") == 1
        assert top.get(key(0)) == kept(blob(0), key(0))  # replaced by the promoted good copy


def test_reads_of_trusted_tiers_skip_the_checksum(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu tier holds the buffers the store verified at put: a hit there is not hashed again; a
    disk hit is (the file crossed a trust boundary), as is the put itself."""
    import kvstore.blob as blob_mod  # noqa: PLC0415

    b = blob(0, key=key(0))  # bound to its key: kept as it is, not hashed again to bind it
    calls: list[int] = []
    real = blob_mod._hashed
    monkeypatch.setattr(blob_mod, "_hashed", lambda *a: calls.append(1) or real(*a))
    cpu, _ = store.tiers
    store.put_blob(key(0), b)
    assert len(calls) == 1
    assert store.get_blob(key(0)) == b and len(calls) == 1
    cpu.delete(key(0))
    assert store.get_blob(key(0)) == b and len(calls) == 2  # from disk, promoted
    assert store.get_blob(key(0)) == b and len(calls) == 2


def test_failing_tiers_are_counted_and_survived(tmp_path: Path) -> None:
    class ExplodingTier(CpuTier):
        def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
            raise RuntimeError("backend on fire")

    s = TieredStore(StoreConfig(), [ExplodingTier(1 << 20, name="boom"), CpuTier(1 << 20)])
    s.tiers[1].put(key(0), blob(0))
    assert s.get_blob(key(0)) == blob(0)  # served by the healthy tier
    assert value(s, "kvstore_tier_errors_total", tier="boom") == 1
    s.close()


def test_metrics_and_stats(tmp_path: Path) -> None:
    cpu = CpuTier(3 * len(blob(0)) + 10)
    disk = DiskTier(tmp_path, 1 << 20)
    with TieredStore(StoreConfig(), [cpu, disk]) as s, TieredStore(StoreConfig(), [CpuTier(100)]) as other:
        for i in range(5):
            s.put_blob(key(i), blob(i))
        s.get_blob(key(4))
        s.get_blob(key(0))  # evicted from cpu: a disk hit
        s.get_blob(key(9))
        n = len(blob(0))
        assert value(s, "kvstore_bytes", tier="cpu") == cpu.usage() == 3 * n
        assert value(s, "kvstore_bytes", tier="disk") == disk.usage() == 5 * n
        assert value(s, "kvstore_capacity_bytes", tier="cpu") == cpu.capacity
        assert value(s, "kvstore_evictions_total", tier="cpu") == 3  # 2 on put, 1 on promotion
        assert value(s, "kvstore_written_bytes_total", tier="disk") == 5 * n
        assert value(s, "kvstore_written_bytes_total", tier="cpu") == 6 * n
        assert value(s, "kvstore_read_bytes_total", tier="disk") == n
        assert value(s, "kvstore_op_seconds_count", op="put") == 5
        assert value(s, "kvstore_op_seconds_count", op="get") == 3
        st = s.stats()
        assert st["hits"] == 2 and st["misses"] == 1 and st["hit_rate"] == pytest.approx(2 / 3)
        assert [t["name"] for t in st["tiers"]] == ["cpu", "disk"]
        assert st["tiers"][0] | {"hits": 1, "misses": 2, "keys": 3, "bytes": 3 * n} == st["tiers"][0]
        assert st["tiers"][1]["hits"] == 1 and st["tiers"][1]["keys"] == 5
        text = generate_latest(s.registry).decode()
        assert 'kvstore_hits_total{tier="disk"} 1.0' in text
        assert value(other, "kvstore_hits_total", tier="cpu") == 0  # registries are per store


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    s = make_store(tmp_path, write_policy="back")
    s.put_blob(key(0), blob(0))
    s.close()
    s.close()
    with pytest.raises(InvalidArgument):
        s.put_blob(key(1), blob(1))
    again = make_store(tmp_path)  # the write-back was drained into the disk tier before close
    assert again.tiers[1].contains(key(0))
    again.close()


@pytest.mark.parametrize(
    "bad",
    [{"write_back_queue": 0}, {"admission_hits": -1}, {"ttl": 0}]
    + [{"ttl": t} for t in (-1, float("nan"), float("inf"))],
)
def test_config_that_cannot_work_is_refused(bad: dict) -> None:
    with pytest.raises(ConfigError):
        TieredStore(StoreConfig(**bad), [CpuTier(1000)])


def test_threads_sharing_a_write_back_store(tmp_path: Path) -> None:
    import random
    import time

    blobs = {i: blob(i) for i in range(24)}
    stored = {i: kept(b, key(i)) for i, b in blobs.items()}
    cpu_cap = 6 * len(blobs[0])
    s = TieredStore(
        StoreConfig(write_policy="back", write_back_queue=8, admission_hits=1),
        [CpuTier(cpu_cap), DiskTier(tmp_path, 1 << 20, fsync=False)],
    )
    errors: list[BaseException] = []
    stop = time.monotonic() + 1.5

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                i = rng.randrange(len(blobs))
                op = rng.random()
                if op < 0.4:
                    s.put_blob(key(i), blobs[i])
                elif op < 0.9:
                    got = s.get_blob(key(i))
                    assert got is None or got == stored[i]
                else:
                    s.delete(key(i))
                assert s.tiers[0].usage() <= cpu_cap
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.flush()
    assert not errors, errors[0]
    for tier in s.tiers:
        for k in tier.keys():
            assert tier.get(k) == stored[int(k, 16)]
    assert s.stats()["tiers"][1]["errors"] == 0
    s.close()
