"""Two kvstore-servers share one fs directory (issue 48 item 2), as two hosts share an NFS or Lustre
mount: a put through one is a hit through the other, bit-exact; an overwrite is never read half-written;
both evicting at once (their puts and their sweeps) lose nothing either just acknowledged. (A writer
SIGKILLed mid-write: test_fs_tier.py.)"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvstore.sdk.remote import RemoteBackend

from kvstore.blob import encode_blob, verify_blob
from kvstore.clock import ManualClock
from kvstore.tiers.fs import FsTier, files
from tests.server.test_cli import CliServer, cli_servers  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


def key(i: int) -> str:
    return f"{i:032x}"


def blob(i: int, version: int, tokens: int = 64) -> bytes:
    g = torch.Generator().manual_seed(i * 1009 + version)
    return encode_blob(torch.randn(2, 2, tokens, 2, 64, generator=g).half(), key=key(i))


def start(
    tmp_path: Path, servers: list[CliServer], capacity: str, sweep_s: float = 30
) -> list[RemoteBackend]:
    shared = tmp_path / "shared"
    out = []
    for name in ("a", "b"):
        srv = CliServer("--tiers", "fs", "--fs-path", str(shared), "--fs-capacity", capacity,
                        "--fs-sweep-interval", str(sweep_s), "--state-dir", str(tmp_path / f"state-{name}"))  # fmt: skip
        servers.append(srv)
        out.append(RemoteBackend(srv.url, retries=0))
    return out


@pytest.fixture
def backends() -> Iterator[list[RemoteBackend]]:
    made: list[RemoteBackend] = []
    yield made
    for be in made:
        be.close()


def test_a_put_through_one_server_is_a_hit_through_the_other(tmp_path, cli_servers, backends) -> None:  # noqa: F811
    a, b = start(tmp_path, cli_servers, "64MiB")
    backends += [a, b]
    assert a.put_blob(key(1), blob(1, 1)) == ["fs"]
    assert b.get_blob(key(1)) == blob(1, 1)  # bit-exact
    assert b.put_blob(key(1), blob(1, 2)) == ["fs"]  # a replace through the other
    assert a.get_blob(key(1)) == blob(1, 2)
    assert b.delete(key(1)) and a.get_blob(key(1)) is None and not a.exists(key(1))
    a.put_blob(key(2), blob(2, 1))
    assert b.batch_exists([key(2), key(1)]) == [True, False]


def test_an_overwrite_is_never_read_half_written(tmp_path, cli_servers, backends) -> None:  # noqa: F811
    a, b = start(tmp_path, cli_servers, "256MiB")
    backends += [a, b]
    versions = [blob(7, 1, tokens=4096), blob(7, 2, tokens=4096)]  # 8 MiB each
    a.put_blob(key(7), versions[0])
    stop = time.monotonic() + 3
    writes = [0]

    def write() -> None:
        w = RemoteBackend(a.url, retries=0)
        try:
            while time.monotonic() < stop:
                w.put_blob(key(7), versions[writes[0] % 2])
                writes[0] += 1
        finally:
            w.close()

    writer = threading.Thread(target=write)
    writer.start()
    reads, bad = 0, []
    while time.monotonic() < stop:
        got = b.get_blob(key(7))
        reads += 1
        if got not in versions:  # a miss, or bytes of neither
            bad.append(None if got is None else len(got))
    writer.join()
    assert writes[0] > 5 and reads > 5 and not bad, (writes, reads, bad[:5])


def test_both_evicting_at_once_lose_nothing_either_just_acknowledged(tmp_path, cli_servers, backends) -> None:  # noqa: F811
    """200 blobs written an hour ago fill the directory twice over (capacity: 100). Both servers then
    overwrite 60 of them with fresh versions, in random orders, while each evicts for its puts and
    sweeps every 50 ms: the old blobs go, every fresh version either acknowledged stays."""
    shared = tmp_path / "shared"
    old = FsTier(shared, 1 << 30, sweep_interval=None, clock=ManualClock(wall=time.time() - 3600))
    for i in range(200):
        old.put(key(i), blob(i, 0))
    old.close()
    size = len(blob(0, 0))
    a, b = start(tmp_path, cli_servers, str(100 * size), sweep_s=0.05)
    backends += [a, b]
    hot = list(range(60))
    acked: dict[int, set[int]] = {i: set() for i in hot}
    lock = threading.Lock()

    def overwrite(be: RemoteBackend, writer: int) -> None:
        rng = random.Random(writer)
        for rnd in range(3):
            for i in rng.sample(hot, len(hot)):
                version = 10 * writer + rnd + 1
                assert be.put_blob(key(i), blob(i, version)) == ["fs"]
                with lock:
                    acked[i].add(version)

    threads = [threading.Thread(target=overwrite, args=(be, w)) for w, be in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in hot:  # every one there, one of its fresh versions (never the old one, never a miss)
        got = a.get_blob(key(i))
        assert got is not None, f"{key(i)} lost"
        assert any(got == blob(i, v) for v in acked[i]), f"{key(i)}: not a version acknowledged"
    evicted = [be.stats()["tiers"][0]["evictions"] for be in (a, b)]
    assert all(evicted), f"both servers evicted while the other wrote: {evicted}"
    for be in (a, b):
        be.close()
    for srv in cli_servers:
        srv.stop()
    survivors = FsTier(shared, 100 * size, sweep_interval=None)
    survivors.sweep()  # the directory within its capacity, the fresh blobs in it
    held = set(survivors.keys())
    assert {key(i) for i in hot} <= held and len(held) <= 100
    assert sum(survivors.get(k) is not None for k in held) == len(held)
    for k in held:
        verify_blob(bytes(survivors.get(k)), key=k)
    assert not list(shared.rglob(f"{files.GONE}*"))
    survivors.close()
