"""The disk tier when its directory is not what it wrote: stray names, vanished files and shards,
non-regular files, a deleted lock file, a full file system, no file descriptors left."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import NotStored
from kvstore.store import TieredStore
from kvstore.tiers.base import TierWriteError
from kvstore.tiers.disk import DiskTier
from tests.blobs import kept

REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> str:
    return f"{i:032x}"


def blob(tokens: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 1, tokens, 1, 64, generator=g).half())


def shard(root: Path, k: str) -> Path:
    return root / k[:2] / k[2:4]


def test_rebuild_maps_only_exact_key_names(tmp_path: Path, caplog) -> None:
    """A file named `<key>\\n` (once accepted through `$` in the key regex) is not `<key>`: a restart
    must neither serve it for `<key>` nor delete the real `<key>` file as its older duplicate."""
    k = "ab" * 16
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(k, blob(2, 1))
    tier.close()
    near_misses = [k + "\n", k + ".x99999999999999\n", k + ".x1\n2", k.upper(), k + ".x" + "\u0661" * 14]
    for name in near_misses:
        (shard(tmp_path, k) / name).write_bytes(blob(2, 9))
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk"):
        again = DiskTier(tmp_path, 1 << 20)
    assert list(again.keys()) == [k]
    assert again.get(k) == blob(2, 1)
    assert (shard(tmp_path, k) / k).is_file()
    for name in near_misses:
        assert (shard(tmp_path, k) / name).exists()  # ignored, never deleted or mapped
        assert repr(str(shard(tmp_path, k) / name)) in caplog.text  # and logged
    again.close()


# -- a full file system: an error, never an acknowledgement -----------------------------------------

MiB = 2**20


def test_disk_full_raises_and_keeps_no_half_blob_and_no_older_blob(tmpfs: Path) -> None:
    tier = DiskTier(tmpfs / "d", 64 * MiB)  # capacity far above the 4 MiB the file system has
    stored: dict[str, bytes] = {}
    errors = []
    for i in range(8):
        b = blob(4096, i)  # 1 MiB + 52 B
        try:
            tier.put(key(i), b)
            stored[key(i)] = b
        except TierWriteError as e:
            errors.append(e)
            assert e.failed == {key(i): "no_space"} and "ENOSPC" in e.detail and not e.stale
            assert not tier.contains(key(i)) and tier.get(key(i)) is None
    assert len(stored) == 3 and len(errors) == 5
    assert tier.usage() == sum(map(len, stored.values())) and sorted(tier.keys()) == sorted(stored)
    assert not list(tmpfs.rglob(".tmp-*")), "a failed write left its temp file"
    for k, b in stored.items():
        assert tier.get(k) == b
    # a replacing put that does not fit must not leave the older blob to be served later
    big = blob(4096 * 2, 99)
    with pytest.raises(TierWriteError):
        tier.put(key(0), big)
    assert tier.get(key(0)) is None and not tier.contains(key(0))
    tier.close()


def test_store_acks_name_the_tiers_and_count_only_written_bytes(tmpfs: Path) -> None:
    config = StoreConfig(
        tiers=["cpu", "disk"], cpu_capacity=64 * MiB, disk_capacity=64 * MiB, disk_path=tmpfs
    )
    with TieredStore(config) as store:
        acks = [store.put_blob(key(i), blob(4096, i)) for i in range(6)]
        assert acks == [["cpu", "disk"]] * 3 + [["cpu"]] * 3  # the disk filled after three
        disk = store.metrics.tier["disk"]
        assert disk.written_bytes._value.get() == 3 * len(blob(4096))
        assert store.metrics.value("kvstore_dropped_writes_total", tier="disk", reason="no_space") == 3
        assert store.stats()["tiers"][1]["dropped_writes"] == 3
        # a replace the disk cannot take: the old disk copy goes, so it can never be served again
        assert store.put_blob(key(0), blob(4096 * 3, 7)) == ["cpu"]
        store.tiers[0].delete(key(0))
        assert store.get_blob(key(0)) is None

    only_disk = StoreConfig(tiers=["disk"], disk_capacity=64 * MiB, disk_path=tmpfs / "other")
    shutil.rmtree(tmpfs / "00", ignore_errors=True)  # (the first store's files, to start empty)
    with TieredStore(only_disk) as store:
        for i in range(3):
            assert store.put_blob(key(i), blob(4096, i)) == ["disk"]
        with pytest.raises(NotStored) as e:
            store.put_blob(key(9), blob(4096, 9))
        assert "disk" in str(e.value) and "ENOSPC" in str(e.value) and e.value.status == 507
        with pytest.raises(NotStored) as e:  # a batch: what landed is said, the rest is the error
            store.batch_put([(key(10), blob(16, 1)), (key(11), blob(4096, 2))])
        assert e.value.stored_in == [["disk"], []]  # type: ignore[attr-defined]
        assert store.get_blob(key(9)) is None and store.get_blob(key(10)) == kept(blob(16, 1), key(10))
        assert store.metrics.value("kvstore_written_bytes_total", tier="disk") == 3 * len(blob(4096)) + len(
            blob(16)
        )


# -- no file descriptors left: the same, with a real RLIMIT_NOFILE ------------------------------------

_FD_CHILD = """
import os, resource, sys
from kvstore.config import StoreConfig
from kvstore.errors import NotStored, Unavailable
from kvstore.store import TieredStore
from tests.blobs import kept
from tests.kvstore.test_disk_faults import blob, key

store = TieredStore(StoreConfig(tiers=["disk"], disk_path=sys.argv[1]))
assert store.put_blob(key(1), blob(16, 1)) == ["disk"]
n_open = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n_open + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass  # every descriptor is taken now
try:
    store.put_blob(key(2), blob(16, 2))
    print("ACKED")
except NotStored as e:
    print("PUT", type(e).__name__, e)
try:
    print("GOT", store.get_blob(key(1)) is not None)
except Unavailable as e:
    print("GET", type(e).__name__, e)
for fd in hog:
    os.close(fd)
print("AFTER", store.get_blob(key(1)) == kept(blob(16, 1), key(1)), store.get_blob(key(2)))
"""


def test_out_of_file_descriptors_is_an_error_not_an_ack_nor_a_miss(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FD_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "ACKED" not in out.stdout, out.stdout + out.stderr
    assert lines.get("PUT", "").startswith("NotStored") and "EMFILE" in lines["PUT"], out.stdout + out.stderr
    assert lines.get("GET", "").startswith("Unavailable") and "EMFILE" in lines["GET"], (
        out.stdout + out.stderr
    )
    assert lines.get("AFTER") == "True None", out.stdout + out.stderr  # the stored blob was there all along


# -- the index follows the directory -----------------------------------------------------------------


def test_a_file_deleted_behind_the_tier_is_absent_for_every_kind_of_read(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(key(1), blob(4, 1))
    tier.put(key(2), blob(4, 2))
    (shard(tmp_path, key(1)) / key(1)).unlink()
    assert not tier.contains(key(1))  # HEAD, exists and lookup ask this: they agree with GET
    assert tier.get(key(1)) is None
    assert sorted(tier.keys()) == [key(2)] and tier.usage() == len(blob(4, 2))
    (shard(tmp_path, key(2)) / key(2)).unlink()
    assert tier.get(key(2)) is None and not tier.contains(key(2)) and len(tier) == 0
    tier.close()


def test_a_removed_shard_directory_is_made_again_on_write(tmp_path: Path) -> None:
    config = StoreConfig(tiers=["disk"], disk_path=tmp_path)
    with TieredStore(config) as store:
        store.put_blob(key(1), blob(4, 1))
        shutil.rmtree(tmp_path / "00")
        assert not store.exists(key(1)) and store.lookup_prefix([key(1)]) == 0
        assert store.put_blob(key(2), blob(4, 2)) == ["disk"]  # same shard: made again, not lost
        assert (shard(tmp_path, key(2)) / key(2)).read_bytes() == kept(blob(4, 2), key(2))
        assert store.get_blob(key(2)) == kept(blob(4, 2), key(2))


def _plant(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/etc/hostname")
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is: reads never end
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "device", "directory"])
def test_non_regular_files_are_refused_without_blocking(tmp_path: Path, kind: str, caplog) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(key(1), blob(4, 1))
    tier.put(key(2), blob(4, 2))
    try:
        _plant(shard(tmp_path, key(1)) / key(1), kind)
    except PermissionError as e:
        pytest.skip(f"cannot make a {kind} here: {e}")
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(tier.get(key(1))), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), f"get blocked on a {kind}"  # a plain open() of a FIFO never returns
    assert got == [None] and not tier.contains(key(1)) and list(tier.keys()) == [key(2)]
    tier.close()
    _plant(shard(tmp_path, key(2)) / key(2), kind)  # and a restart ignores such files
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk"):
        again = DiskTier(tmp_path, 1 << 20)
    assert len(again) == 0 and "not a regular file" in caplog.text
    again.close()


_SECOND_OWNER = """
import sys
from kvstore.errors import ConfigError
from kvstore.tiers.disk import DiskTier
try:
    DiskTier(sys.argv[1], 1000)
    print("SHARED")
except ConfigError as e:
    print("REFUSED", e)
"""


def test_the_directory_lock_survives_a_deleted_lock_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1000)
    for stray in tmp_path.glob(".lock*"):  # whatever a lock file would be: delete it
        stray.unlink()
    out = subprocess.run(
        [sys.executable, "-c", _SECOND_OWNER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.stdout.startswith("REFUSED") and "in use" in out.stdout, out.stdout + out.stderr
    tier.close()
    out = subprocess.run(
        [sys.executable, "-c", _SECOND_OWNER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.stdout.startswith("SHARED"), out.stdout + out.stderr  # free once the owner closed it
