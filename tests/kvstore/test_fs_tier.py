"""The fs tier's own behaviour (the conformance suite, test_tier_conformance.py, covers the Tier contract):
its files are bound to their keys, tombstones, sweeps by age and capacity on a stepped clock, removal by
identity, a writer SIGKILLed mid-write, two writers evicting at once; and settings."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore.blob import encode_blob, verify_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.tiers import make_tier
from kvstore.tiers.base import TierWriteError
from kvstore.tiers.fs import FsTier, files, sweep
from tests.valkey import wait_until

REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> str:
    return f"{i:032x}"


def blob(i: int, tokens: int = 4, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(i * 31 + seed)
    return encode_blob(torch.randn(2, 1, tokens, 1, 64, generator=g).half(), key=key(i))


SIZE = len(blob(0))


def tier(path: Path, clock: ManualClock, capacity: int = 1 << 24, **kw: object) -> FsTier:
    return FsTier(path, capacity, sweep_interval=None, clock=clock, **kw)  # type: ignore[arg-type]


def test_a_file_is_bound_to_its_key_and_its_name(tmp_path: Path) -> None:
    t = tier(tmp_path, ManualClock())
    t.put(key(1), blob(1))
    t.put(key(2), blob(2))
    path = tmp_path / key(1)[:2] / key(1)
    raw = path.read_bytes()
    assert raw[:4] == b"KVFS" and raw.endswith(blob(1)) and len(raw) == files.header_size(key(1)) + SIZE
    os.replace(tmp_path / key(2)[:2] / key(2), path)  # key 2's file under key 1's name
    assert t.get(key(1)) is None and not t.contains(key(1)) and t.stats.extra["foreign"] == 2
    path.write_bytes(b"not ours at all")
    assert t.get(key(1)) is None
    (path.parent / f"{files.TMP}{key(3)}-h-1-1").write_bytes(raw)  # temp files are never read
    assert t.get(key(3)) is None and sorted(t.keys()) == []
    t.close()


def test_a_delete_is_a_tombstone_that_a_sweep_removes_later(tmp_path: Path) -> None:
    clock = ManualClock()
    t = tier(tmp_path, clock)
    t.put(key(1), blob(1))
    assert t.delete(key(1)) and not t.delete(key(1)) and not t.delete(key(2))  # absent: no tombstone
    path = tmp_path / key(1)[:2] / key(1)
    assert path.stat().st_size == files.header_size(key(1)) and t.get(key(1)) is None
    assert not (tmp_path / key(2)[:2] / key(2)).exists()
    assert t.sweep() == 0 and path.exists()  # young: kept (a removal racing it cannot undo the delete)
    clock.advance(files.TOMBSTONE_S + 1)
    assert t.sweep() == 1 and not path.exists()
    t.close()


def test_sweeps_evict_by_age_and_by_capacity_least_recently_used_first(tmp_path: Path) -> None:
    clock = ManualClock()
    t = tier(tmp_path, clock, capacity=6 * SIZE, max_age=600)
    other = tier(tmp_path, clock, capacity=6 * SIZE, max_age=600)  # another server on the directory
    for i in range(6):
        t.put(key(i), blob(i))
        clock.advance(60)
    assert t.get(key(0)) is not None  # used: young again
    clock.advance(250)  # key 1 was last used 550 s ago, key 2 490 s...
    other.put(key(6), blob(6))
    other.put(key(7), blob(7))  # the directory: 8 blobs, over 6 blobs' capacity
    assert t.sweep() == 2  # the two least recently used go
    assert [t.contains(key(i)) for i in range(8)] == [True, False, False] + [True] * 5
    clock.advance(200)  # key 3 was last used 630 s ago, key 4 570 s ago
    assert other.sweep() == 1 and not t.contains(key(3)) and t.contains(key(4))
    assert t.stats.extra["swept_files"] == 2 and other.stats.extra["swept_files"] == 1
    assert t.usage() == 5 * SIZE and len(t) == 5  # its view follows the directory after a sweep
    t.close()
    other.close()


def test_a_sweep_never_takes_what_was_used_within_the_grace_period(tmp_path: Path) -> None:
    clock = ManualClock()
    a = tier(tmp_path, clock, capacity=10 * SIZE)
    b = tier(tmp_path, clock, capacity=10 * SIZE)
    for i in range(20):
        (a if i < 10 else b).put(key(i), blob(i))  # 20 blobs, capacity 10: all just written
        clock.advance(0.001)
    assert a.sweep() == 0 and b.sweep() == 0 and len(list(a.keys())) == 20
    clock.advance(sweep.GRACE_S + 1)
    assert a.get(key(0)) is not None  # used
    assert a.sweep() == 10 and sorted(a.keys()) == sorted([key(0)] + [key(i) for i in range(11, 20)])
    a.close()
    b.close()


def test_a_put_never_evicts_another_servers_blob_used_within_the_grace_period(tmp_path: Path) -> None:
    clock = ManualClock()
    a = tier(tmp_path, clock, capacity=4 * SIZE)
    b = tier(tmp_path, clock, capacity=4 * SIZE)
    for i in range(10, 14):
        b.put(key(i), blob(i))
        clock.advance(0.001)
    a.sweep()  # a's view: b's four blobs, full
    assert len(a) == 4 and a.put(key(0), blob(0)) == []  # b's least recent left a's view, not the directory
    assert b.contains(key(10)) and len(a) == 4
    clock.advance(sweep.GRACE_S + 1)
    assert a.put(key(1), blob(1)) == [key(11)] and not b.contains(key(11))  # no longer just written
    a.close()
    b.close()


def test_a_removal_by_identity_puts_back_a_file_replaced_since(tmp_path: Path) -> None:
    clock = ManualClock()
    a = tier(tmp_path, clock)
    a.put(key(1), blob(1, seed=1))
    path = tmp_path / key(1)[:2] / key(1)
    seen = files.FileId.of(path.stat())
    clock.advance(1)
    b = tier(tmp_path, clock)
    b.put(key(1), blob(1, seed=2))  # replaced after `seen`
    assert not files.remove_if(path, seen) and bytes(a.get(key(1))) == blob(1, seed=2)
    assert files.remove_if(path, files.FileId.of(path.stat())) and a.get(key(1)) is None
    assert not list(tmp_path.rglob(f"{files.GONE}*"))
    a.close()
    b.close()


def test_a_lost_mount_is_an_outage_not_an_empty_directory(tmp_path: Path) -> None:
    """An unmounted NFS leaves its empty mount point: nothing is written there, a delete is remembered
    and replayed once the directory is back, never the older blob served."""
    root, away = tmp_path / "mnt", tmp_path / "away"
    t = FsTier(root, 1 << 24, sweep_interval=None, handoff_dir=tmp_path / "state")
    t.put(key(1), blob(1))
    t.put(key(2), blob(2))
    root.rename(away)
    root.mkdir()  # the mount point, empty
    with pytest.raises(TierWriteError):
        t.put(key(3), blob(3))
    assert t.delete(key(1)) and t.get(key(1)) is None  # remembered
    with pytest.raises(TierWriteError):
        t.put(key(2), blob(2, seed=1))
    assert not any(root.iterdir())  # nothing under the mount point
    root.rmdir()
    away.rename(root)  # mounted again
    assert t.get(key(1)) is None and t.get(key(2)) is None  # invalidated: never the older blobs
    wait_until(lambda: t.stats.extra["invalidated"] == 0)  # replayed: tombstones
    assert t.get(key(1)) is None and t.get(key(2)) is None
    t.close()
    again = FsTier(root, 1 << 24, sweep_interval=None)
    assert again.get(key(1)) is None and again.get(key(2)) is None
    again.close()


def test_settings_blocks_flags_and_a_missing_path(tmp_path: Path) -> None:
    config = StoreConfig(
        tiers=["fs"], fs_path=tmp_path, fs_capacity="1MiB", fs_max_age=60, state_dir=tmp_path / "s"
    )
    assert config.tier("fs").capacity == 1 << 20 and config.fs_max_age == 60
    t = make_tier("fs", config)
    assert isinstance(t, FsTier) and t.root == tmp_path and t.max_age == 60
    t.close()
    with pytest.raises(ConfigError, match="fs_path"):
        make_tier("fs", StoreConfig(tiers=["fs"]))
    with pytest.raises(ConfigError, match="fs_max_age"):
        StoreConfig(fs={"path": str(tmp_path), "max_age": 0})


_WRITER = """
import sys, torch
from kvstore.blob import encode_blob
from kvstore.tiers.fs import FsTier
tier = FsTier(sys.argv[1], 1 << 34, sweep_interval=None)
g = torch.Generator().manual_seed(0)
blobs = [encode_blob(torch.randn(2, 1, t, 1, 64, generator=g).half()) for t in (16384, 32768, 49152, 65536)]
i = int(sys.argv[2])
while True:  # nearly all the time goes into writing 8-32 MiB files, so a kill lands inside one
    key = f"{i:032x}"
    tier.put(key, blobs[i % 4])
    print(key, flush=True)  # acknowledged: put returned
    i += 1
"""


@pytest.mark.slow
def test_sigkill_mid_write_leaves_no_readable_partial_blob(tmp_path: Path) -> None:
    acked: list[str] = []
    temps: list[Path] = []
    for cycle in range(6):  # until a kill has landed inside a write
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(cycle * 1000)],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            assert child.stdout is not None
            for _ in range(random.randint(2, 5)):
                line = child.stdout.readline()
                assert line, "writer died"
                acked.append(line.strip())
            time.sleep(random.uniform(0, 0.02))  # somewhere inside the next write (not a time-based wait)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        acked.extend(line.strip() for line in child.stdout)
        temps = list(tmp_path.rglob(f"{files.TMP}*"))
        if temps:
            break
    assert temps, "no kill landed inside a write; the test proved nothing"
    clock = ManualClock()
    t = tier(tmp_path, clock, capacity=1 << 34)
    try:
        stored = set(t.keys())
        assert set(acked) <= stored
        for k in stored:  # every readable blob is whole: its checksum holds
            assert verify_blob(bytes(t.get(k))).shape[2] >= 16384
        assert all(t.get(p.name.split("-")[1]) is None or p.name.split("-")[1] in stored for p in temps)
        t.sweep()
        assert list(tmp_path.rglob(f"{files.TMP}*"))  # a live writer's may be in flight: kept an hour
        clock.advance(files.TMP_MAX_AGE_S + 60)
        t.sweep()
        assert not list(tmp_path.rglob(f"{files.TMP}*")) and set(t.keys()) == stored
    finally:
        t.close()
