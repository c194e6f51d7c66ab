"""The disk tier when its directory is not what it wrote: stray names, vanished files and shards,
non-regular files, a deleted lock file, a full file system, no file descriptors left."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvstore.blob import encode_blob
from kvstore.tiers.disk import DiskTier


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
