"""The worker maps a CPU KV cache's pages when the engine registers it, so a fresh engine's first loads
do not fault page by page; nothing in the cache changes."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from kvstore.connectors import kv_worker

from tests.connectors.sim import make_config

MiB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_maps_every_page_and_changes_nothing() -> None:
    fresh = mmap.mmap(-1, 64 * MiB)  # pages of its own, none present yet (an allocator may reuse some)
    t = torch.frombuffer(fresh, dtype=torch.uint8)
    t[: 8 * MiB] = 7  # already written: must stay so
    before = resident_bytes()
    kv_worker.populate([t[: 32 * MiB], t[32 * MiB :]])
    assert resident_bytes() - before >= 48 * MiB  # the 56 MiB never touched, less what else was freed
    assert bool((t[: 8 * MiB] == 7).all()) and not t[8 * MiB :].any()
    del t


def test_registering_kv_caches_populates_them(engines, monkeypatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(kv_worker, "populate", lambda caches: seen.append(len(caches)))
    engines(make_config(local_cpu_capacity="64MiB"))
    assert seen == [3]  # the sim engine's 3 layers, once
