"""The cpu tier's shared arena (kvstore.tiers.arena): regions live exactly as long as a buffer of their
blob, a put makes room by LRU when the free space is fragmented, and nobody else can write it."""

from __future__ import annotations

import gc
import mmap
import os

import pytest

from kvstore.protocol import shm
from kvstore.tiers.arena import Arena, arena_size
from kvstore.tiers.cpu import CpuTier

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
MiB = 1 << 20


def blob(i: int, n: int = MiB) -> bytes:
    return bytes([i % 251]) * n


def test_a_region_is_free_once_its_last_buffer_goes() -> None:
    arena = Arena(4 * MiB)
    before = arena.free_bytes()
    view = arena.store(blob(1))
    assert bytes(view) == blob(1) and view.readonly
    assert arena.offset_of(view) is not None and arena.offset_of(blob(1)) is None
    part = view[10:20]
    del view
    assert arena.free_bytes() < before  # a slice still holds it
    del part
    gc.collect()
    assert arena.free_bytes() == before
    arena.close()


def test_the_shared_tier_stores_copies_and_counts_bytes_exactly() -> None:
    tier = CpuTier(4 * MiB, memory="arena")
    for i in range(10):  # 10 MiB through a 4 MiB tier
        tier.put(f"{i:032x}", blob(i))
    assert tier.usage() == 4 * MiB and len(tier) == 4
    got = tier.get(f"{9:032x}")
    assert bytes(got) == blob(9) and tier.arena.offset_of(got) is not None
    assert tier.get(f"{0:032x}") is None
    tier.close()


def test_eviction_stays_lru_by_bytes_and_a_blob_without_a_region_is_kept_outside() -> None:
    tier = CpuTier(8 * MiB, memory="arena")
    assert tier.arena.size == arena_size(8 * MiB)
    for i in range(32):  # small blobs everywhere...
        tier.put(f"{i:032x}", blob(i, MiB // 4))
    held = [tier.get(f"{i:032x}") for i in range(0, 32, 2)]  # ...every other one lent to a client
    evicted = tier.put(f"{99:032x}", blob(99, 3 * MiB))  # no 3 MiB hole anywhere
    assert evicted == [f"{i:032x}" for i in range(1, 24, 2)]  # exactly the 3 MiB least recently used
    got = tier.get(f"{99:032x}")
    assert bytes(got) == blob(99, 3 * MiB) and tier.arena.offset_of(got) is None
    assert tier.stats.extra["spilled_bytes"] == 3 * MiB and tier.usage() == 8 * MiB
    assert [bytes(h) for h in held] == [blob(i, MiB // 4) for i in range(0, 32, 2)]  # untouched
    del got
    tier.delete(f"{99:032x}")
    assert tier.stats.extra["spilled_bytes"] == 0
    tier.put(f"{98:032x}", blob(98, MiB // 4))  # a region the evictions freed
    assert tier.arena.offset_of(tier.get(f"{98:032x}")) is not None
    tier.close()


def test_no_other_process_can_map_the_arena_writable() -> None:
    arena = Arena(MiB)
    path = f"/proc/{os.getpid()}/fd/{arena.segment.fd}"
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, arena.size)
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        ro = mmap.mmap(fd, arena.size, prot=mmap.PROT_READ)
        ro.close()
    finally:
        os.close(fd)
    view = arena.store(blob(5, 100))  # the owner's own mapping still writes
    assert bytes(view) == blob(5, 100)
    del view
    arena.close()
