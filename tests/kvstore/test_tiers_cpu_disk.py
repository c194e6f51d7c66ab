"""The cpu and disk tiers' own behaviour: memory kinds, the disk layout, warm restarts, crash safety,
threads. The Tier contract itself (round trips, LRU, TTL, never-older, overwrites...) is the
conformance suite's, which every tier runs (test_tier_conformance.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidArgument, InvalidKey
from kvstore.lru import check_ttl
from kvstore.tiers import make_tier
from kvstore.tiers.base import Tier
from kvstore.tiers.cpu import CpuTier, resolve_memory
from kvstore.tiers.disk import TMP_PREFIX, DiskTier

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def key(i: int) -> str:
    return f"{i:032x}"


def blob(tokens: int, seed: int = 0) -> bytes:
    """A real blob of 52 + tokens * 256 bytes."""
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 1, tokens, 1, 64, generator=g).half())


SIZE = len(blob(1))  # 308


def make_kind(kind: str, capacity: int, path: Path) -> Tier:
    """cpu, cpu-shared (its blobs in the arena, as in a kvstore-server with shared memory) or disk."""
    if kind == "disk":
        return DiskTier(path, capacity, fsync=False)
    return CpuTier(capacity, memory="arena" if kind == "cpu-shared" else "plain")


BAD_TTLS = [0, -1, -0.5, float("nan"), float("inf"), float("-inf"), True, "1"]


def test_check_ttl_is_shared_by_every_tier() -> None:
    for good in (None, 1e-3, 1, 30.5, 1e9):
        assert check_ttl(good) == good
    for bad in BAD_TTLS:
        with pytest.raises(InvalidArgument):
            check_ttl(bad)  # type: ignore[arg-type]


def test_cpu_get_is_zero_copy_for_bytes() -> None:
    tier = CpuTier(10 * SIZE, memory="plain")
    b = blob(1)
    tier.put(key(0), b)
    assert tier.get(key(0)) is b
    buf = bytearray(b)
    tier.put(key(1), buf)
    buf[60] ^= 1  # the tier copied a mutable buffer
    assert tier.get(key(1)) == b


def test_cpu_memory_is_a_setting_that_cuda_does_not_override() -> None:
    """Issue 35 #5: with CUDA present the tier pinned its memory and built no arena even when asked
    for one, so a kvstore-server beside a GPU vLLM lost its same-host reads. Where the blobs live is
    one setting now; "auto" alone looks at CUDA, "pinned" without it is a clear error."""
    assert resolve_memory("arena", cuda=True) == "arena" and resolve_memory("plain", cuda=True) == "plain"
    assert resolve_memory("auto", cuda=True) == "pinned" and resolve_memory("auto", cuda=False) == "plain"
    with pytest.raises(ConfigError, match="pinned needs CUDA"):
        resolve_memory("pinned", cuda=False)
    with pytest.raises(ConfigError):
        StoreConfig(cpu_memory="tape")
    tier = CpuTier(MiB, memory="arena")  # an arena on this host whatever torch says
    assert tier.memory == "arena" and tier.arena is not None and not tier.pinned
    tier.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_cpu_tier_without_cuda_uses_plain_memory() -> None:
    assert not CpuTier(100).pinned and CpuTier(100).memory == "plain"
    with pytest.raises(ConfigError, match="pinned needs CUDA"):
        CpuTier(100, memory="pinned")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_tier_pins_host_memory_with_cuda() -> None:
    tier = CpuTier(10 * SIZE)
    assert tier.pinned
    b = blob(1)
    tier.put(key(0), b)
    got = tier.get(key(0))
    assert isinstance(got, memoryview) and got.readonly and bytes(got) == b
    assert tier.get(key(0)).obj is got.obj  # the same pinned buffer every time, no copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about read-only buffers
        assert torch.frombuffer(got, dtype=torch.uint8).is_pinned()
    assert tier.usage() == len(b)


def test_make_tier(tmp_path: Path) -> None:
    config = StoreConfig(cpu_capacity="1MiB", disk_capacity="2MiB", disk_path=tmp_path)
    cpu, disk = make_tier("cpu", config), make_tier("disk", config)
    assert isinstance(cpu, CpuTier) and cpu.capacity == 2**20
    assert isinstance(disk, DiskTier) and disk.capacity == 2 * 2**20 and disk.root == tmp_path
    disk.close()
    with pytest.raises(ConfigError):
        make_tier("tape", config)


# -- disk specifics --------------------------------------------------------------------------------


def test_disk_layout_and_warm_restart(tmp_path: Path) -> None:
    clock = ManualClock()
    tier = DiskTier(tmp_path, 10 * SIZE, clock=clock)
    for i in range(5):
        tier.put(key(i), blob(1, i), ttl_s=30 if i == 4 else None)
        clock.advance(0.01)  # distinct mtimes: the disk tier sets them from its clock
    tier.get(key(0))  # LRU order now 1 2 3 4 0
    tier.put(key(9), blob(1, 9), ttl_s=0.2)
    assert (tmp_path / "00" / "00" / key(1)).is_file()
    assert len(list((tmp_path / "00" / "00").glob(f"{key(4)}.x*"))) == 1
    tier.close()
    clock.advance(0.3)  # key 9 expires while the tier is down
    (tmp_path / "00" / "00" / f"{TMP_PREFIX}{key(7)}-1-1").write_bytes(b"half a blob")
    (tmp_path / "00" / "00" / "notes.txt").write_text("not ours")

    again = DiskTier(tmp_path, 4 * SIZE, clock=clock)  # smaller now: the least recently used must go
    assert sorted(again.keys()) == sorted([key(3), key(4), key(0), key(2)])
    assert again.usage() == 4 * SIZE
    assert not list(tmp_path.rglob(f"{TMP_PREFIX}*")) and not list(tmp_path.rglob(f"{key(9)}*"))
    assert (tmp_path / "00" / "00" / "notes.txt").exists()  # strangers are left alone
    for i in (0, 2, 3, 4):
        clock.advance(0.01)
        assert bytes(again.get(key(i))) == blob(1, i)
    again.put(key(5), blob(1, 5))  # LRU after the gets above: 0 2 3 4 -> 0 goes
    assert not again.contains(key(0))
    again.close()


def test_disk_directory_is_owned_by_one_tier(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1000)
    with pytest.raises(ConfigError):
        DiskTier(tmp_path, 1000)
    tier.close()
    DiskTier(tmp_path, 1000).close()


def test_disk_rejects_keys_that_are_not_file_safe(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1000)
    with pytest.raises(InvalidKey):
        tier.put("../../etc/passwd", blob(1))
    tier.close()


_WRITER = """
import sys, torch
from kvstore.blob import encode_blob
from kvstore.tiers.disk import DiskTier
tier = DiskTier(sys.argv[1], 1 << 34)
g = torch.Generator().manual_seed(0)
blobs = [encode_blob(torch.randn(2, 1, t, 1, 64, generator=g).half()) for t in (4096, 8192, 12288, 16384)]
i = int(sys.argv[2])
while True:  # nearly all the time goes into writing 1-4 MiB files, so a kill lands inside one
    key = f"{i:032x}"
    tier.put(key, blobs[i % 4])
    print(key, flush=True)  # acknowledged: put returned
    i += 1
"""


def _run_and_kill(path: Path, first: int) -> tuple[list[str], int]:
    """Start a writer on `path`, SIGKILL it after a few acks; return (acked keys, temp files left)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(first)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    acked: list[str] = []
    try:
        assert child.stdout is not None
        target = random.randint(6, 12)
        while len(acked) < target:
            line = child.stdout.readline()
            assert line, "writer died"
            acked.append(line.strip())
        time.sleep(random.uniform(0, 0.01))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    acked.extend(line.strip() for line in child.stdout)  # acks already in the pipe count too
    return acked, len(list(path.rglob(f"{TMP_PREFIX}*")))


@pytest.mark.slow
def test_disk_sigkill_mid_write_loses_no_acknowledged_blob(tmp_path: Path) -> None:
    acked: list[str] = []
    half_written = 0
    for cycle in range(4):  # restart on the same directory until a kill has hit a write in progress
        keys, temps = _run_and_kill(tmp_path, first=cycle * 1000)
        acked += keys
        half_written += temps
        if half_written:
            break
    assert half_written, "no kill landed inside a write; the test proved nothing"

    tier = DiskTier(tmp_path, 1 << 34)
    try:
        assert not list(tmp_path.rglob(f"{TMP_PREFIX}*"))  # leftovers removed on start
        stored = set(tier.keys())
        assert set(acked) <= stored
        assert len(stored) <= len(acked) + cycle + 1  # at most the one being renamed per kill
        for k in stored:  # every readable blob verifies, acked or not
            data = tier.get(k)
            assert data is not None
            verify_blob(data)
            assert decode_blob(data).shape[2] >= 4096
        assert tier.usage() == sum(p.stat().st_size for p in tmp_path.glob("??/??/*"))
    finally:
        tier.close()


# -- threads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "cpu-shared", "disk"])
def test_four_threads_hammering_keep_capacity_accounting_and_lru(kind: str, tmp_path: Path) -> None:
    blobs = [blob(t, t) for t in (1, 2, 3, 5, 8)]
    capacity = 12 * SIZE
    tier = make_kind(kind, capacity, tmp_path)
    stop = time.monotonic() + (2.0 if kind == "disk" else 3.0)
    over: list[int] = []
    bad: list[str] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            k = key(rng.randrange(40))
            if rng.random() < 0.5:
                tier.put(k, rng.choice(blobs))
            else:
                got = tier.get(k)
                if got is not None and bytes(got) not in blobs:
                    bad.append(k)
            if tier.usage() > capacity:
                over.append(tier.usage())

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over and not bad
    stored = {k: tier.get(k) for k in tier.keys()}
    assert all(v is not None for v in stored.values())
    assert tier.usage() == sum(len(v) for v in stored.values()) <= capacity
    for v in stored.values():
        verify_blob(v)
    if isinstance(tier, DiskTier):
        assert tier.usage() == sum(p.stat().st_size for p in tmp_path.glob("??/??/*"))
        assert not list(tmp_path.rglob(f"{TMP_PREFIX}*"))
    # LRU still exact afterwards: touch in a known order, then push out exactly the oldest ones
    order = list(stored)
    random.Random(1).shuffle(order)
    for k in order:
        tier.get(k)
    must_evict = tier.usage() + len(blobs[4]) > capacity
    evicted = tier.put(key(1000), blobs[4])
    assert evicted == order[: len(evicted)] and bool(evicted) == must_evict
    tier.close()
