"""A replace never lets an older blob back, whatever the write policy: a dropped write-back, a write-back
left queued at close, a blob never admitted (admission_hits) all leave a miss below once the newer
blob leaves the top tier, never the older one. Real cpu and disk tiers; the disk tier is reopened as a
restarted process would."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.protocol import Blob
from kvstore.store import TieredStore
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from tests.blobs import kept


def key(i: int) -> str:
    return f"{i:032x}"


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, 4, 1, 16, generator=g).half())


SIZE = len(blob(0))


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait while the gate is closed: a slow lower tier."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 1 << 24)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.left = threading.Event()

    def put_many(self, items: Sequence[tuple[str, Blob]], ttl_s: float | None = None) -> list[str]:
        self.entered.set()
        assert self.gate.wait(30)
        try:
            return super().put_many(items, ttl_s)
        finally:
            self.left.set()


def write_back_store(disk: DiskTier, queue: int = 1) -> TieredStore:
    config = StoreConfig(tiers=["cpu", "disk"], write_policy="back", write_back_queue=queue)
    return TieredStore(config, [CpuTier(2 * SIZE), disk])


def dropped(s: TieredStore) -> float:
    labels = {"tier": "disk", "reason": "queue_full"}
    return s.registry.get_sample_value("kvstore_dropped_writes_total", labels) or 0.0


def test_a_dropped_write_back_never_lets_the_older_blob_back(tmp_path: Path) -> None:
    disk = GatedDisk(tmp_path / "disk")
    s = write_back_store(disk)
    try:
        s.put_blob(key(1), blob(1))
        s.flush()
        assert disk.get(key(1)) == kept(blob(1), key(1))
        disk.gate.clear()
        disk.entered.clear()
        s.put_blob(key(8), blob(8))
        assert disk.entered.wait(10)  # the writer holds key 8 at the gate
        s.put_blob(key(9), blob(9))  # queued: the queue is full now
        assert s.put_blob(key(1), blob(11)) == ["cpu"]  # acknowledged; its write-back dropped
        assert dropped(s) == 1
        s.put_blob(key(7), blob(7))
        s.put_blob(key(6), blob(6))  # evicts key 1 (v2) from cpu
        assert not s.tiers[0].contains(key(1))
        assert s.get_blob(key(1)) is None  # a miss, never blob(1)
        disk.gate.set()
        s.flush()
        assert s.get_blob(key(1)) is None
    finally:
        disk.gate.set()
        s.close()
    again = DiskTier(tmp_path / "disk", 1 << 24)  # a restart finds no older blob either
    try:
        assert again.get(key(1)) is None
    finally:
        again.close()


def test_a_replace_while_the_older_blob_is_being_written_back(tmp_path: Path) -> None:
    """v1's write-back is in flight when v2 is put and v2's is dropped: v1 is taken back out below."""
    disk = GatedDisk(tmp_path / "disk")
    s = write_back_store(disk)
    try:
        disk.gate.clear()
        s.put_blob(key(1), blob(1))
        assert disk.entered.wait(10)  # v1 on its way down
        s.put_blob(key(9), blob(9))  # fills the queue
        s.put_blob(key(1), blob(11))  # v2: its write-back is dropped
        disk.gate.set()
        s.flush()
        s.tiers[0].delete(key(1))  # v2 leaves cpu
        assert disk.get(key(1)) is None and s.get_blob(key(1)) is None
    finally:
        disk.gate.set()
        s.close()


def test_close_drains_within_its_timeout_and_leaves_no_older_blob(tmp_path: Path) -> None:
    disk = GatedDisk(tmp_path / "disk")
    s = write_back_store(disk, queue=8)
    for i in range(4):
        s.put_blob(key(i), blob(i))
    s.flush()
    disk.gate.clear()
    disk.entered.clear()
    disk.left.clear()
    s.put_blob(key(9), blob(9))
    assert disk.entered.wait(10)
    for i in range(4):
        s.put_blob(key(i), blob(100 + i))  # queued behind the gate
    t0 = time.monotonic()
    s.close(timeout=0.5)
    assert time.monotonic() - t0 < 5
    disk.gate.set()  # (the stuck write lands after close: key 9, the newest)
    assert disk.left.wait(10)
    again = DiskTier(tmp_path / "disk", 1 << 24)
    try:
        assert [again.get(key(i)) for i in range(4)] == [None] * 4  # not written: a miss, not blob(i)
    finally:
        again.close()


def test_a_replace_drops_the_admitted_copy_below(tmp_path: Path) -> None:
    """admission_hits=1: v1 read once is admitted to disk; v2 (not admitted yet) evicted from cpu: the
    key is a miss, never v1."""
    config = StoreConfig(tiers=["cpu", "disk"], disk_path=tmp_path / "disk", admission_hits=1)
    s = TieredStore(config, [CpuTier(2 * SIZE), DiskTier(tmp_path / "disk", 1 << 24)])
    try:
        s.put_blob(key(1), blob(1))
        assert s.get_blob(key(1)) == kept(blob(1), key(1))
        assert s.tiers[1].contains(key(1))  # admitted
        assert s.put_blob(key(1), blob(11)) == ["cpu"]
        s.put_blob(key(2), blob(2))
        s.put_blob(key(3), blob(3))  # evicts v2
        assert not s.tiers[0].contains(key(1))
        assert s.get_blob(key(1)) is None
    finally:
        s.close()
