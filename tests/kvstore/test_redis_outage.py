"""Consistency through a Redis outage, against a real valkey-server that is SIGKILLed (and comes back
with its data: AOF) or SIGSTOPped (hung): a delete or a replacing put that could not reach Redis is
remembered and replayed when it answers again; until then Redis never serves the older blob; when the
bounded set of remembered keys is full the request fails (503) instead, and keeps failing. With a
handoff directory the remembered keys survive a restart of the store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import Unavailable
from kvstore.store import TieredStore
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.redis import RedisTier
from tests.blobs import kept
from tests.valkey import ValkeyProcess, wait_until

PREFIX = "outage:"
# Data that survives a SIGKILL: what a real deployment with persistence (or a network cut) looks like
DURABLE = ("--appendonly", "yes", "--appendfsync", "always")


def key(i: int) -> str:
    return f"{i:032x}"


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, 4, 2, 8, generator=g).half())


@pytest.fixture
def durable(valkey_factory) -> ValkeyProcess:
    return valkey_factory(*DURABLE)


def make_store(
    server: ValkeyProcess,
    max_invalidated: int = 1000,
    socket_timeout_s: float = 2.0,
    handoff_dir: Path | None = None,
) -> TieredStore:
    redis_tier = RedisTier(
        server.url,
        prefix=PREFIX,
        max_invalidated=max_invalidated,
        socket_timeout_s=socket_timeout_s,
        handoff_dir=handoff_dir,
    )
    return TieredStore(StoreConfig(tiers=["cpu", "redis"]), [CpuTier(1 << 24), redis_tier])


@pytest.fixture
def store(durable: ValkeyProcess) -> Iterator[TieredStore]:
    s = make_store(durable)
    yield s
    s.close()


def in_redis(server: ValkeyProcess, k: str) -> bytes | None:
    with server.client() as c:
        return c.get(PREFIX + k)


def test_a_delete_during_an_outage_is_replayed_and_never_resurrects(durable, store) -> None:
    store.put_blob(key(1), blob(1))
    store.put_blob(key(5), blob(5))
    durable.kill()
    assert store.delete(key(1)) is True  # remembered, not lost
    assert store.get_blob(key(1)) is None
    redis_tier = store.tiers[1]  # batches that mix an invalidated key with others
    assert redis_tier.get_many([key(1), key(5)]) == [None, None]
    assert redis_tier.contains_many([key(1), key(5)]) == [False, False]
    durable.start()  # the AOF brings the old blob back on the server
    assert in_redis(durable, key(1)) == kept(blob(1), key(1))
    store.tiers[0].delete(key(5))  # only redis has key 5: batches mix it with the invalidated key 1
    for _ in range(20):  # from the moment it answers until the replay: a miss, never the old blob
        assert store.get_blob(key(1)) is None and not store.exists(key(1))
        assert store.lookup_prefix([key(1)]) == 0
        assert store.batch_exists([key(5), key(1)]) in ([True, False], [False, False])  # (5: in backoff)
        assert store.tiers[1].get_many([key(1), key(5)])[0] is None
    wait_until(lambda: in_redis(durable, key(1)) is None)  # replayed
    wait_until(lambda: store.batch_exists([key(5), key(1)]) == [True, False])  # and out of backoff
    assert store.tiers[1].get_many([key(1), key(5)]) == [None, kept(blob(5), key(5))]
    assert store.get_blob(key(1)) is None
    wait_until(lambda: store.tiers[1].stats.extra["invalidated"] == 0)


def test_a_replace_during_an_outage_never_lets_the_old_blob_back(durable, store) -> None:
    store.put_blob(key(2), blob(1))
    durable.kill()
    assert store.put_blob(key(2), blob(2)) == ["cpu"]  # the ack says where it is: not in redis
    durable.start()
    store.tiers[0].delete(key(2))  # the cpu copy is evicted
    assert store.get_blob(key(2)) is None  # a miss, never blob(1) from redis
    wait_until(lambda: in_redis(durable, key(2)) is None)
    assert store.put_blob(key(2), blob(3)) == ["cpu", "redis"]  # and the key works normally again
    store.tiers[0].delete(key(2))
    assert store.get_blob(key(2)) == kept(blob(3), key(2))


def test_a_hung_redis_sigstop_is_handled_the_same(durable) -> None:
    store = make_store(durable, socket_timeout_s=0.3)
    try:
        store.put_blob(key(3), blob(1))
        store.put_blob(key(4), blob(1))
        durable.pause()
        try:
            assert store.delete(key(3)) is True  # times out after 0.3 s: remembered
            assert store.put_blob(key(4), blob(4)) == ["cpu"]
            store.tiers[0].delete(key(4))
            assert store.get_blob(key(3)) is None and store.get_blob(key(4)) is None
        finally:
            durable.resume()
        for _ in range(20):
            assert store.get_blob(key(3)) is None and store.get_blob(key(4)) is None
        wait_until(lambda: in_redis(durable, key(3)) is None and in_redis(durable, key(4)) is None)
    finally:
        store.close()


def test_when_the_set_is_full_deletes_and_replaces_fail_loudly(durable) -> None:
    store = make_store(durable, max_invalidated=2)
    try:
        for i in range(5):
            store.put_blob(key(i), blob(i))
        durable.kill()
        assert store.delete(key(0)) and store.delete(key(1))  # two fit
        with pytest.raises(Unavailable) as e:
            store.delete(key(2))
        assert "redis" in str(e.value) and e.value.status == 503
        with pytest.raises(Unavailable):  # a replace of a blob redis holds: also refused
            store.put_blob(key(3), blob(33))
        assert store.put_blob(key(9), blob(9)) == ["cpu"]  # a key redis never had needs no room
        durable.start()
        wait_until(lambda: in_redis(durable, key(0)) is None and in_redis(durable, key(1)) is None)
        assert store.delete(key(2)) is True and in_redis(durable, key(2)) is None  # room again
    finally:
        store.close()


def test_a_refused_delete_stays_refused_and_an_unrecorded_replace_is_not_acknowledged(durable) -> None:
    """Past the limit the key must stay known as held: a retried delete is a 503 again (never a 404
    while Redis holds the blob), a replace is a 503 (never a 201 that the older blob outlives), and the
    refused replace's new blob is taken back, so no read serves it and then the older one."""
    store = make_store(durable, max_invalidated=2)
    try:
        for i in range(4):
            store.put_blob(key(i), blob(i))
        durable.kill()
        assert store.delete(key(0)) and store.delete(key(1))  # two fit
        for _ in range(3):
            with pytest.raises(Unavailable):
                store.delete(key(2))
        for k in (key(2), key(3)):
            with pytest.raises(Unavailable):
                store.put_blob(k, blob(33))
        assert store.get_blob(key(3)) is None  # neither the refused blob nor (redis down) the old one
        assert store.put_blob(key(9), blob(9)) == ["cpu"]  # a key redis never had needs no room
        durable.start()
        wait_until(lambda: in_redis(durable, key(0)) is None and in_redis(durable, key(1)) is None)
        wait_until(lambda: store.get_blob(key(3)) is not None)  # out of backoff
        assert store.get_blob(key(3)) == kept(blob(3), key(3))  # the acknowledged ones
        assert store.get_blob(key(2)) == kept(blob(2), key(2))
        assert store.delete(key(2)) is True and in_redis(durable, key(2)) is None
    finally:
        store.close()


def test_invalidations_survive_a_restart_of_the_store(durable, tmp_path: Path) -> None:
    """A delete (204) and a replace (201, cpu only) made while Redis is down, then the store closed and
    opened again (a new process's view: empty cpu tier) before Redis returns: the deleted and the older
    blob are never served; both are deleted on Redis once it answers."""
    handoff = tmp_path / "handoff"
    store = make_store(durable, handoff_dir=handoff)
    store.put_blob(key(1), blob(1))
    store.put_blob(key(2), blob(2))
    durable.kill()
    assert store.delete(key(1)) is True
    assert store.put_blob(key(2), blob(22)) == ["cpu"]
    store.close()
    again = make_store(durable, handoff_dir=handoff)
    try:
        assert again.tiers[1].stats.extra["invalidated"] == 2
        durable.start()  # the AOF brings both old blobs back
        assert in_redis(durable, key(1)) == kept(blob(1), key(1))
        assert in_redis(durable, key(2)) == kept(blob(2), key(2))
        for _ in range(20):
            assert again.get_blob(key(1)) is None and again.get_blob(key(2)) is None
        wait_until(lambda: in_redis(durable, key(1)) is None and in_redis(durable, key(2)) is None)
        wait_until(lambda: again.tiers[1].stats.extra["invalidated"] == 0)
        assert again.put_blob(key(2), blob(3)) == ["cpu", "redis"]
    finally:
        again.close()
    assert not any(p.stat().st_size for p in handoff.glob("*.log"))  # nothing waits: the log is empty


def test_an_invalidation_that_cannot_be_made_durable_is_refused(durable, tmpfs: Path) -> None:
    """The handoff directory on a full file system: the delete or replace is a 503, not a 204/201 that
    a restart would forget."""
    store = make_store(durable, handoff_dir=tmpfs / "handoff")
    try:
        store.put_blob(key(1), blob(1))
        store.put_blob(key(2), blob(2))
        filler = tmpfs / "filler"
        with pytest.raises(OSError), filler.open("wb") as f:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        durable.kill()
        with pytest.raises(Unavailable):
            store.delete(key(1))
        with pytest.raises(Unavailable):
            store.put_blob(key(2), blob(22))
        filler.unlink()
        assert store.delete(key(1)) is True  # room again: remembered
        durable.start()
        wait_until(lambda: in_redis(durable, key(1)) is None)
        assert store.get_blob(key(2)) in (None, kept(blob(2), key(2)))  # the acknowledged blob or a miss
    finally:
        store.close()


def test_a_torn_journal_record_never_swallows_the_next_one(durable) -> None:
    """Issue 45's repro on a real 1 MiB tmpfs and a real Valkey outage: the journal's last page has
    less room than a record, the disk is full, a delete is refused (503) after part of its record was
    written; room again, the next delete is acknowledged; after a restart of the store, then of Valkey,
    the acknowledged delete is replayed and its blob never served."""
    from tests.fsfaults import small_tmpfs  # noqa: PLC0415

    with small_tmpfs("1m") as mnt:
        store = make_store(durable, handoff_dir=mnt / "handoff")
        n = 300
        try:
            for i in range(n):
                store.put_blob(key(i), blob(i))
            durable.kill()
            (log,) = (mnt / "handoff").glob("*.log")
            record = len(f"+{key(0)} 00000000\n")
            i = 0
            while not 0 < 4096 - log.stat().st_size % 4096 < record:  # the last page: room for part of one
                assert store.delete(key(i)) is True
                i += 1
                assert i < n - 2
            filler = mnt / "filler"
            with pytest.raises(OSError), filler.open("wb", buffering=0) as f:
                for size in (65536, 4096, 1):
                    try:
                        while True:
                            f.write(b"x" * size)
                    except OSError:
                        if size == 1:
                            raise
            size_before = log.stat().st_size
            with pytest.raises(Unavailable):
                store.delete(key(n - 2))  # K_a: refused...
            assert log.stat().st_size == size_before  # ...and nothing of its record is left
            filler.unlink()
            assert store.delete(key(n - 1)) is True  # K_b: acknowledged
        finally:
            store.close()
        again = make_store(durable, handoff_dir=mnt / "handoff")
        try:
            durable.start()  # the AOF brings the old blobs back
            assert in_redis(durable, key(n - 1)) == kept(blob(n - 1), key(n - 1))
            for _ in range(20):
                assert again.get_blob(key(n - 1)) is None
            wait_until(lambda: in_redis(durable, key(n - 1)) is None)
            assert in_redis(durable, key(n - 2)) == kept(
                blob(n - 2), key(n - 2)
            )  # the refused delete changed nothing
        finally:
            again.close()
