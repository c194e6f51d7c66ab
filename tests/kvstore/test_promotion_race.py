"""A copy made from a read (promotion of a lower-tier hit, admission of a top-tier hit) never lands
over a write of the same key that raced it: a reader holding v1 from disk while a writer stores v2
(or deletes the key) must not put v1 back into cpu. Real cpu and disk tiers; the disk tier's read is
held at a gate so the writer runs between the read and the copy."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.protocol import Blob
from kvstore.store import TieredStore
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier

KEY = "ab" * 16


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, 4, 1, 16, generator=g).half(), key=KEY)


class GatedReads(DiskTier):
    """A real disk tier whose reads, once armed, wait at a gate after reading: a slow lower tier."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 1 << 24)
        self.armed = False
        self.read = threading.Event()
        self.gate = threading.Event()

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:  # type: ignore[override]
        out = super().get_many(list(keys))
        if self.armed:
            self.armed = False
            self.read.set()
            assert self.gate.wait(30)
        return out


def racing_read(s: TieredStore, disk: GatedReads) -> tuple[threading.Thread, list[Blob | None]]:
    """Start a get of KEY that has read the disk copy and waits before promoting it."""
    s.tiers[0].delete(KEY)  # v1 only below: the next read promotes it
    disk.armed = True
    got: list[Blob | None] = []
    reader = threading.Thread(target=lambda: got.append(s.get_blob(KEY)))
    reader.start()
    assert disk.read.wait(10)
    return reader, got


def store(tmp_path: Path, **config: object) -> tuple[TieredStore, GatedReads]:
    disk = GatedReads(tmp_path / "disk")
    s = TieredStore(StoreConfig(tiers=["cpu", "disk"], **config), [CpuTier(1 << 20), disk])
    return s, disk


def test_a_promotion_never_lands_over_a_newer_put(tmp_path: Path) -> None:
    s, disk = store(tmp_path)
    with s:
        s.put_blob(KEY, blob(1))
        reader, got = racing_read(s, disk)
        assert s.put_blob(KEY, blob(2)) == ["cpu", "disk"]  # acknowledged while the reader holds v1
        disk.gate.set()
        reader.join(10)
        assert bytes(got[0]) == blob(1)  # the racing read itself may answer what it read
        assert bytes(s.get_blob(KEY)) == blob(2)  # but v1 was not copied over v2
        s.tiers[0].delete(KEY)
        assert bytes(s.get_blob(KEY)) == blob(2)


def test_a_promotion_never_brings_back_a_deleted_key(tmp_path: Path) -> None:
    s, disk = store(tmp_path)
    with s:
        s.put_blob(KEY, blob(1))
        reader, _ = racing_read(s, disk)
        assert s.delete(KEY)
        disk.gate.set()
        reader.join(10)
        assert s.get_blob(KEY) is None


def test_a_promotion_never_lands_over_a_write_back_put(tmp_path: Path) -> None:
    s, disk = store(tmp_path, write_policy="back")
    with s:
        s.put_blob(KEY, blob(1))
        s.flush()
        reader, _ = racing_read(s, disk)
        assert s.put_blob(KEY, blob(2)) == ["cpu"]
        disk.gate.set()
        reader.join(10)
        s.flush()
        assert bytes(s.get_blob(KEY)) == blob(2)


def test_a_promotion_with_no_write_beside_it_still_happens(tmp_path: Path) -> None:
    s, disk = store(tmp_path)
    with s:
        s.put_blob(KEY, blob(1))
        reader, _ = racing_read(s, disk)
        disk.gate.set()
        reader.join(10)
        assert s.tiers[0].contains(KEY)


class GatedCpu(CpuTier):
    """A real cpu tier whose reads, once armed, wait at a gate after reading."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.armed = False
        self.read = threading.Event()
        self.gate = threading.Event()

    def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        out = super().get_many(keys)
        if self.armed:
            self.armed = False
            self.read.set()
            assert self.gate.wait(30)
        return out


def test_an_admission_never_writes_down_over_a_newer_put(tmp_path: Path) -> None:
    cpu, disk = GatedCpu(), DiskTier(tmp_path / "disk", 1 << 24)
    s = TieredStore(StoreConfig(tiers=["cpu", "disk"], admission_hits=1), [cpu, disk])
    with s:
        s.put_blob(KEY, blob(1))  # on probation: cpu only
        cpu.armed = True
        reader = threading.Thread(target=s.get_blob, args=(KEY,))
        reader.start()
        assert cpu.read.wait(10)  # the read that admits v1 has it in hand
        assert s.put_blob(KEY, blob(2)) == ["cpu"]
        cpu.gate.set()
        reader.join(10)
        cpu.delete(KEY)  # v2 leaves cpu: what is below must not be v1
        got = s.get_blob(KEY)
        assert got is None or bytes(got) == blob(2)


def test_the_fence_forgets_old_writes_only_by_refusing_copies() -> None:
    from kvstore.write_fence import WriteFence

    fence = WriteFence(capacity=2)
    since = fence.now()
    for k in ("a", "b", "c"):  # "a" is forgotten: its end stands in as the floor
        with fence.writing([k]):
            pass
    with fence.copying(["a", "b", "z"], since) as ok:
        assert ok == [False, False, False]  # z was never written, but the floor is past `since`
    with fence.copying(["a", "z"], fence.now()) as ok:
        assert ok == [True, True]
    with fence.writing(["q"]), fence.copying(["q"], fence.now()) as ok:
        assert ok == [False]  # a write in progress: no copy
