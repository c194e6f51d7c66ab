"""The tier conformance suite: what every registered kind of tier must do (docs/design.md §4), run by
tests/kvstore/test_tier_conformance.py against each one (cpu, disk, redis standalone and Cluster, fs,
gpu where CUDA is present, and a kind that test registers itself).

A `Harness` says how to reach one kind: the settings of a fresh, empty tier of it, whether it keeps its
capacity itself (exact LRU by blob bytes) or its backend does (Redis' maxmemory), whether its TTLs run
on the store's clock or the backend's, and how to make its backend unreachable. Every tier is built
the way a store builds it, by `make_tier` from a StoreConfig's block, on a `ManualClock` the checks
step: no check sleeps to let time pass. The checks (`CHECKS`):

- round trips of every bytes-like, batches in order, `keys`, `len`, `usage` exactly the blob bytes;
- the never-older rules: a replace serves the new blob at once, a delete a miss, a put that failed
  (too large) leaves no older blob, through a reopen of a durable tier too;
- eviction within capacity (LRU, the evicted keys returned) or, for a backend's capacity, writes past
  it keep working and the newest blobs read back;
- TTLs (stepped on the clock, or waited on for a backend's own clock), bad TTLs refused unchanged;
- corrupt and foreign blobs (bound to another key) are a counted miss through the store, deleted; a
  tier that skips the checksum (`trusted`) must be an in-process one;
- outages: reads miss without raising, writes raise naming why, a delete or replace made meanwhile
  never lets the older blob back once the backend returns (replayed where the tier declares hinted
  handoff; refused as stale where it does not);
- KV events under the declared medium; a shared tier is not in the first snapshot, a local one is;
- the declarations hold: a durable tier's blobs survive a reopen, a shared tier's puts and deletes
  through one instance are seen through another (another server);
- an overwrite raced by readers reads as the old or the new blob, never a miss.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.blob import encode_blob
from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.store import TieredStore
from kvstore.tier_registry import tier_spec
from kvstore.tiers import Tier, make_tier
from kvstore.tiers.base import BACKEND_ERROR, IO_ERROR, TOO_LARGE, UNAVAILABLE, TierWriteError
from tests.valkey import wait_until

KiB = 1 << 10


def key(i: int) -> str:
    return f"{i:032x}"


def blob(i: int, tokens: int = 4, seed: int = 0) -> bytes:
    """A real blob bound to key(i): 4 tokens ~ 1.1 KiB."""
    g = torch.Generator().manual_seed(i * 7919 + seed)
    return encode_blob(torch.randn(2, 1, tokens, 1, 64, generator=g).half(), key=key(i))


SIZE = len(blob(0))


@dataclass
class Harness:
    """How the suite reaches one kind of tier (see the module docstring)."""

    name: str  # the registered tier
    settings: Callable[[int], dict[str, Any]]  # capacity -> the block of a fresh, empty tier
    state_dir: Path
    exact_capacity: bool = True  # False: the backend's own (Redis maxmemory)
    backend_capacity: int = 0  # with exact_capacity False: what the backend was given (0: unbounded)
    clock_expiry: bool = True  # False: the backend expires by its own clock
    outage: Callable[[dict[str, Any]], contextlib.AbstractContextManager[None]] | None = None  # (its block)
    no_outage: str = "a local tier: no backend to lose"  # why there is no `outage`
    recover_s: float = 30.0  # how far the clock steps once the backend is back (breaker backoffs)
    clock: ManualClock = field(default_factory=ManualClock)
    made: list[Any] = field(default_factory=list)

    @property
    def spec(self) -> Any:
        return tier_spec(self.name)

    def config(self, block: dict[str, Any]) -> StoreConfig:
        return StoreConfig(tiers=[self.name], state_dir=self.state_dir, **{self.name: block})

    def block(self, capacity: int = 64 * SIZE) -> dict[str, Any]:
        return self.settings(capacity)

    def tier(self, block: dict[str, Any] | None = None) -> Tier:
        t = make_tier(self.name, self.config(block if block is not None else self.block()), self.clock)
        self.made.append(t)
        return t

    def store(self, block: dict[str, Any] | None = None) -> TieredStore:
        s = TieredStore(self.config(block if block is not None else self.block()), clock=self.clock)
        self.made.append(s)
        return s

    def close(self) -> None:
        for t in reversed(self.made):
            with contextlib.suppress(Exception):
                t.close()
        self.made.clear()


def read(t: Tier, k: str) -> bytes | None:
    got = t.get(k)
    return None if got is None else bytes(got)


def close(h: Harness, t: Any) -> None:
    t.close()
    if t in h.made:
        h.made.remove(t)


# -- the checks -------------------------------------------------------------------------------------


def check_round_trips(h: Harness) -> None:
    t = h.tier()
    assert isinstance(t, Tier) and t.name == h.name
    assert t.get(key(0)) is None and not t.contains(key(0)) and len(t) == 0 and t.usage() == 0
    b0, b1, b2 = blob(0), blob(1), blob(2, tokens=8)
    assert t.put(key(0), b0) == []
    assert read(t, key(0)) == b0 and t.contains(key(0))
    t.put_many([(key(1), bytearray(b1)), (key(2), memoryview(b2))])
    got = t.get_many([key(2), key(9), key(1), key(0)])
    assert [None if g is None else bytes(g) for g in got] == [b2, None, b1, b0]
    assert sorted(t.keys()) == [key(0), key(1), key(2)] and len(t) == 3
    assert t.usage() == len(b0) + len(b1) + len(b2)
    many = getattr(t, "contains_many", None)
    if many is not None:
        assert list(many([key(1), key(9), key(2)])) == [True, False, True]
    assert t.delete(key(1)) and not t.delete(key(1))
    assert t.get(key(1)) is None and not t.contains(key(1)) and t.usage() == len(b0) + len(b2)
    assert len(t) == 2 and sorted(t.keys()) == [key(0), key(2)]


def check_never_older(h: Harness) -> None:
    block = h.block(8 * SIZE) if h.exact_capacity else h.block()
    t = h.tier(block)
    t.put(key(0), blob(0, seed=1))
    t.put(key(0), blob(0, seed=2))  # a replace serves the new blob at once
    assert read(t, key(0)) == blob(0, seed=2) and len(t) == 1 and t.usage() == SIZE
    t.put(key(1), blob(1))
    assert t.delete(key(1)) and t.get(key(1)) is None and not t.contains(key(1))
    too_big = 9 * SIZE if h.exact_capacity else h.backend_capacity + SIZE
    t.put(key(2), blob(2))
    if h.exact_capacity or h.backend_capacity:
        with pytest.raises(TierWriteError) as e:  # not stored, and the older blob is gone too
            t.put(key(2), blob(2, tokens=too_big // 256))
        assert e.value.failed == {key(2): TOO_LARGE} and not e.value.stale
    else:  # an unbounded backend: a delete instead
        t.delete(key(2))
    assert t.get(key(2)) is None and not t.contains(key(2))
    if h.spec.durable:  # and still so after a restart
        close(h, t)
        t = h.tier(block)
        assert read(t, key(0)) == blob(0, seed=2)
        assert t.get(key(1)) is None and t.get(key(2)) is None


def check_capacity(h: Harness) -> None:
    if not h.exact_capacity:  # the backend evicts: writes past it keep working, the newest read back
        t = h.tier()
        n = 3 * h.backend_capacity // SIZE or 64  # (unbounded: nothing to evict)
        for i in range(n):
            t.put(key(i), blob(i))
        assert all(read(t, key(i)) == blob(i) for i in range(n - 8, n))
        assert t.usage() <= n * SIZE
        return
    t = h.tier(h.block(4 * SIZE + SIZE // 2))
    for i in range(4):
        assert t.put(key(i), blob(i)) == []
    assert t.get(key(0)) is not None  # 0 is now the most recently used: order 1, 2, 3, 0
    assert t.contains(key(1))  # contains does not refresh
    assert t.put(key(4), blob(4)) == [key(1)]
    big = blob(5, tokens=8)  # two slots
    assert t.put(key(5), big) == [key(2), key(3)]
    assert sorted(t.keys()) == [key(0), key(4), key(5)]
    assert t.usage() == 2 * SIZE + len(big) <= t.capacity
    assert t.stats.evictions == 3
    with pytest.raises(TierWriteError) as e:  # a batch stores what fits and names the rest
        t.put_many([(key(6), blob(6, tokens=40)), (key(7), blob(7))])
    assert e.value.failed == {key(6): TOO_LARGE} and t.contains(key(7)) and t.usage() <= t.capacity


def check_ttl(h: Harness) -> None:
    block = h.block()
    t = h.tier(block)
    if not h.clock_expiry:  # the backend's own clock: one side is a condition to wait for
        t.put(key(0), blob(0), ttl_s=0.05)
        t.put(key(1), blob(1), ttl_s=3600)
        t.put(key(2), blob(2))
        wait_until(lambda: t.get(key(0)) is None and not t.contains(key(0)), timeout=10)
        assert read(t, key(1)) == blob(1) and read(t, key(2)) == blob(2)
        return
    t.put(key(0), blob(0), ttl_s=5)
    t.put(key(1), blob(1), ttl_s=3600)
    t.put(key(2), blob(2))
    h.clock.advance(4.9)
    assert read(t, key(0)) == blob(0) and t.contains(key(0))
    h.clock.advance(0.2)
    assert t.get(key(0)) is None and not t.contains(key(0))
    assert sorted(t.keys()) == [key(1), key(2)] and read(t, key(1)) == blob(1)
    t.put(key(3), blob(3))  # a put may sweep; either way the expired blob is gone
    assert t.get(key(0)) is None and t.stats.expired >= 1
    t.put(key(4), blob(4), ttl_s=1)
    h.clock.advance(3600)
    assert [t.get(key(i)) for i in (1, 4)] == [None, None] and read(t, key(2)) == blob(2)
    if h.spec.durable:  # expiry survives a restart
        t.put(key(5), blob(5), ttl_s=10)
        close(h, t)
        h.clock.advance(11)
        t = h.tier(block)
        assert t.get(key(5)) is None and read(t, key(2)) == blob(2)


def check_bad_ttls(h: Harness) -> None:
    t = h.tier(h.block(64 * SIZE))
    t.put(key(0), blob(0))
    for bad in (0, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            t.put(key(0), blob(0, seed=1), ttl_s=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="ttl_s"):
            t.put_many([(key(1), blob(1))], ttl_s=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="ttl_s"):
            t.put_many([], ttl_s=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="ttl_s"):  # too big to store: still refused first
            t.put(key(0), blob(0, tokens=80 * SIZE // 256), ttl_s=bad)  # type: ignore[arg-type]
    assert read(t, key(0)) == blob(0) and not t.contains(key(1)) and t.usage() == SIZE


def check_corrupt_and_foreign(h: Harness) -> None:
    s = h.store()
    t = s.tiers[0]
    assert s.put_blob(key(0), blob(0)) == [h.name]  # the acknowledgement names the tier
    if getattr(t, "trusted", False):  # it skips the checksum: only in-process memory may
        assert h.spec.in_memory, f"{h.name} is trusted, but its blobs leave this process"
        return
    bad = bytearray(blob(1))
    bad[-1] ^= 0xFF  # a flipped payload byte
    t.put(key(1), bytes(bad))
    t.put(key(2), blob(3))  # a good blob, bound to another key
    reasons: list[str | None] = []
    assert s.batch_get([key(1), key(2), key(0)], reasons)[:2] == [None, None]
    assert reasons == ["corrupt", "corrupt", None]
    assert not t.contains(key(1)) and not t.contains(key(2))  # deleted
    assert s.registry.get_sample_value("kvstore_corrupt_blobs_total", {"tier": h.name}) == 2
    assert s.get_blob(key(0)) == blob(0)


@contextlib.contextmanager
def _events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    from kvstore import store_events  # noqa: PLC0415

    batches: list[Any] = []

    class Captured:
        def __init__(self, config: Any, token: str | None = None) -> None:
            pass

        def publish(self, evs: list[Any]) -> None:
            batches.append(list(evs))

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(store_events, "ZmqEventPublisher", Captured)
    yield batches


def check_events(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.events import parse_kv_events_config  # noqa: PLC0415
    from kvstore.store_events import StoreEvents  # noqa: PLC0415

    block = h.block(4 * SIZE + SIZE // 2) if h.exact_capacity else h.block()
    s = h.store(block)
    s.put_blob(key(0), blob(0))
    config = parse_kv_events_config({"enable_kv_cache_events": True, "reconcile_s": 0})
    with _events(monkeypatch) as batches:
        ev = StoreEvents(s, config)
        first = batches[0][0]
        assert type(first).__name__ == "AllBlocksCleared"
        listed = [b for batch in batches[1:] for e in batch for b in e.block_hashes]
        assert listed == ([] if h.spec.shared else [bytes.fromhex(key(0))])  # shared: not listed
        batches.clear()
        s.put_blob(key(1), blob(1))
        s.delete(key(1))
        (stored,), (removed,) = batches[:2]
        assert (type(stored).__name__, stored.block_hashes) == ("BlockStored", [bytes.fromhex(key(1))])
        assert (type(removed).__name__, removed.block_hashes) == ("BlockRemoved", [bytes.fromhex(key(1))])
        assert stored.medium == removed.medium == h.spec.medium
        if h.exact_capacity:  # an eviction is a BlockRemoved too
            batches.clear()
            for i in range(2, 7):
                s.put_blob(key(i), blob(i))
            gone = [b for batch in batches for e in batch if type(e).__name__ == "BlockRemoved"
                    for b in e.block_hashes]  # fmt: skip
            assert gone and all(not s.exists(k.hex()) for k in gone)
        ev.shutdown()


def check_outage(h: Harness) -> None:
    if h.outage is None:
        pytest.skip(f"{h.name}: {h.no_outage}")
    block = h.block()
    t = h.tier(block)
    t.put(key(1), blob(1, seed=1))
    t.put(key(2), blob(2, seed=1))
    with h.outage(block):
        assert t.get(key(1)) is None and not t.contains(key(1))  # a miss, never an exception
        assert t.get_many([key(1), key(2)]) == [None, None]
        with pytest.raises(TierWriteError) as e:
            t.put(key(3), blob(3))
        assert e.value.failed[key(3)] in (UNAVAILABLE, IO_ERROR, BACKEND_ERROR), e.value.failed
        try:  # a delete: remembered (hinted handoff) or refused as stale, never silently lost
            t.delete(key(1))
            assert h.spec.handoff, f"{h.name} accepted a delete it cannot replay"
        except TierWriteError as d:
            assert key(1) in d.stale
        with pytest.raises(TierWriteError):  # a replace that cannot reach the backend
            t.put(key(2), blob(2, seed=2))
        assert t.get(key(1)) is None and t.get(key(2)) is None
    h.clock.advance(h.recover_s)  # past any backoff

    def answers() -> bool:
        try:
            t.put(key(4), blob(4))
            return read(t, key(4)) == blob(4)
        except TierWriteError:
            h.clock.advance(h.recover_s)
            return False

    wait_until(answers, timeout=30)
    for _ in range(5):  # the older blobs never come back
        assert t.get(key(1)) is None and t.get(key(2)) is None
    if h.spec.handoff:
        wait_until(lambda: t.stats.extra.get("invalidated", 0) == 0, timeout=30)  # replayed
        if h.spec.durable:
            close(h, t)
            again = h.tier(block)
            assert again.get(key(1)) is None and again.get(key(2)) is None


def check_declarations(h: Harness) -> None:
    spec = h.spec
    assert spec.medium and spec.in_memory == (not spec.shared and not spec.durable)
    if spec.handoff:
        assert spec.shared, "hinted handoff replays into a backend others share"
    block = h.block()
    t = h.tier(block)
    t.put(key(0), blob(0))
    if spec.shared:  # another server on the same backend sees its puts and deletes
        other = h.tier(block)
        assert read(other, key(0)) == blob(0)
        other.put(key(1), blob(1))
        assert read(t, key(1)) == blob(1)
        other.delete(key(0))
        assert t.get(key(0)) is None
        t.put(key(0), blob(0))
        close(h, other)
    if spec.durable:  # its blobs outlive the process
        close(h, t)
        t = h.tier(block)
        assert read(t, key(0)) == blob(0)


def check_overwrite_race(h: Harness) -> None:
    blobs = [blob(0, tokens=40, seed=1), blob(0, tokens=40, seed=2)]
    block = h.block(3 * len(blobs[0])) if h.exact_capacity else h.block()
    t = h.tier(block)
    t.put(key(0), blobs[0])
    t.put(key(1), blob(1))
    stop = time.monotonic() + 0.5
    misses, wrong, reads = [0], [0], [0]

    def reader() -> None:
        while time.monotonic() < stop:
            got = t.get(key(0))
            reads[0] += 1
            if got is None:
                misses[0] += 1
            elif bytes(got) not in blobs:
                wrong[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    i = 0
    while time.monotonic() < stop:
        t.put(key(0), blobs[i % 2])
        i += 1
    for th in threads:
        th.join()
    assert i > 3 and reads[0] > 3 and (misses[0], wrong[0]) == (0, 0), (misses, wrong, reads, i)
    assert t.get(key(1)) is not None  # the old blob's room was enough: nothing else was evicted


CHECKS: dict[str, Callable[..., None]] = {
    "round_trips": check_round_trips,
    "never_older": check_never_older,
    "capacity": check_capacity,
    "ttl": check_ttl,
    "bad_ttls": check_bad_ttls,
    "corrupt_and_foreign": check_corrupt_and_foreign,
    "events": check_events,
    "outage": check_outage,
    "declarations": check_declarations,
    "overwrite_race": check_overwrite_race,
}


def run(h: Harness, check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One check against `h` (the events check patches the publisher through `monkeypatch`)."""
    fn = CHECKS[check]
    try:
        fn(h, monkeypatch) if check == "events" else fn(h)
    finally:
        h.close()
