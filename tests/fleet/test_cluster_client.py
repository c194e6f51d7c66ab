"""The redis tier follows a 3+3 Valkey Cluster as a real client does: keys of a slot being migrated
keep hitting (ASK -> ASKING on the target, the map unchanged), a finished migration is a MOVED
followed once (the map updated), a primary SIGKILLed is replaced by its replica with no restart of
the tier, and its replicated keys hit again."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from kvstore.tiers.redis import RedisTier
from tests.fleet.conftest import NODE_TIMEOUT_MS, keys_by_slot
from tests.valkey import ValkeyCluster, wait_until


@pytest.fixture
def prefix() -> str:
    return f"f{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def tier(cluster33: ValkeyCluster, prefix: str) -> Iterator[RedisTier]:
    t = RedisTier(cluster33.urls, prefix=prefix, cluster=True)
    yield t
    t.close()


def test_keys_of_migrating_slots_keep_hitting(tier: RedisTier, cluster33: ValkeyCluster, prefix: str) -> None:
    owners = cluster33.slot_owners()
    src, dst = cluster33.primaries()[:2]
    slots = keys_by_slot(prefix, src, owners, n_slots=3, per_slot=6)
    blobs = {k: os.urandom(300 + i) for i, k in enumerate(k for ks in slots.values() for k in ks)}
    assert tier.put_many(list(blobs.items())) == []
    seen: list[tuple[int, int]] = []  # (hits, asked) per half-moved slot

    def half_moved(slot: int) -> None:
        keys = slots[slot]
        got = tier.get_many(keys)
        singles = [tier.get(k) for k in keys]
        assert got == [blobs[k] for k in keys] and singles == got, "a key of a migrating slot missed"
        assert tier.contains_many(keys) == [True] * len(keys)
        new = f"new-{slot}"  # a put into a migrating slot: ASKed to the target (absent on src)
        while key_slot((prefix + new).encode()) != slot:
            new += "x"
        assert tier.put(new, b"during the move") == [] and tier.get(new) == b"during the move"
        blobs[new] = b"during the move"
        seen.append((len(keys), int(tier.stats.extra.get("ask", 0))))

    errors = tier.stats.errors
    moved = cluster33.migrate_slots(list(slots), src, dst, between=half_moved)
    assert moved >= 18 and len(seen) == 3
    assert tier.stats.extra.get("ask", 0) > 0, "no ASK was ever answered: nothing was half moved"
    assert tier.stats.extra.get("moved", 0) == 0, "an ASK must not touch the slot map"
    wait_until(lambda: all(cluster33.slot_owners()[s] is dst for s in slots), timeout=10)
    # the moves are done: the tier still thinks src owns them -> MOVED, followed, the map updated
    assert tier.get_many(list(blobs)) == list(blobs.values())
    assert all(tier.get(k) == b for k, b in blobs.items())
    assert tier.stats.extra.get("moved", 0) >= 1
    assert tier.stats.errors == errors, "a redirect was counted as an error"
    assert {tier._servers.owner((prefix + k).encode()) for k in blobs} == {f"127.0.0.1:{dst.port}"}


def test_primary_killed_its_replica_takes_over(
    tier: RedisTier, cluster33: ValkeyCluster, prefix: str
) -> None:
    victim = cluster33.primaries()[-1]
    replica = cluster33.replica_of(victim)
    owners = cluster33.slot_owners()
    blobs = {f"{i:032x}": os.urandom(1000) for i in range(60)}
    tier.put_many(list(blobs.items()))
    on_victim = [k for k in blobs if owners[key_slot((prefix + k).encode())] is victim]
    assert on_victim
    with victim.client() as c:
        assert c.execute_command("WAIT", 1, 2000) >= 1  # replicated before the crash
    victim.kill()
    killed = time.monotonic()
    try:
        assert tier.get(on_victim[0]) is None  # out of reach: a miss, not an error to the caller

        def back() -> bool:
            return tier.get_many(on_victim) == [blobs[k] for k in on_victim]

        wait_until(back, timeout=NODE_TIMEOUT_MS / 1000 + 5, interval=0.1)  # no restart of anything
        took = time.monotonic() - killed
        assert all(cluster33.slot_owners()[key_slot((prefix + k).encode())] is replica for k in on_victim)
        assert tier.get_many(list(blobs)) == list(blobs.values())
        tier.put(on_victim[0], b"after the failover")
        assert tier.get(on_victim[0]) == b"after the failover"
        assert took < NODE_TIMEOUT_MS / 1000 + 5
    finally:
        victim.start()  # rejoins as a replica of the promoted one
        cluster33.wait_ok()
        cluster33.wait_replicas()


def test_wait_replicas_acknowledges_only_replicated_writes(cluster33: ValkeyCluster, prefix: str) -> None:
    """wait_replicas=1: a put is stored once its primary's replica has it (WAIT 1); asking for more
    replicas than there are is a TierWriteError naming the shortfall (not a silent success), and the
    blob itself is still readable (it is the new one)."""
    from kvstore.tiers.base import TierWriteError

    items = [(f"{i:032x}", os.urandom(2000)) for i in range(12)]
    one = RedisTier(cluster33.urls, prefix=prefix, cluster=True, wait_replicas=1)
    two = RedisTier(cluster33.urls, prefix=prefix, cluster=True, wait_replicas=2)
    try:
        assert one.put_many(items) == [] and one.put(items[0][0], items[0][1]) == []
        owners = cluster33.slot_owners()
        for k, b in items:  # on the replica already, read straight from it
            with cluster33.replica_of(owners[key_slot((prefix + k).encode())]).client() as r:
                r.execute_command("READONLY")
                assert r.get(prefix + k) == b
        with pytest.raises(TierWriteError) as e:
            two.put(f"{99:032x}", b"only one replica")
        assert "WAIT 2: 1 replicas acknowledged" in str(e.value)
        assert one.get(f"{99:032x}") == b"only one replica"
    finally:
        one.close()
        two.close()
