"""The simulated kvstore: one kvstore-server per node of engines (an optional memory tier each) in front
of a shared Valkey Cluster tier, with kvstore's rules (docs/design.md §4): tiers looked up in order, the
longest run of leading chunks wins and the first gap ends it, a hit below is promoted up, a put is
written to the top tier and through to the ones below, each tier evicts LRU within its capacity
(kvstore.lru.LRUIndex, the index the real tiers use)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from kvstore.fleet_sim.network import Link

from kvstore.lru import Entry, LRUIndex

UNBOUNDED = 2**62  # an LRUIndex capacity nothing reaches


def gib_bytes(gib: float) -> int:
    return UNBOUNDED if math.isinf(gib) else int(gib * 2**30)


@dataclass
class Tier:
    name: str
    capacity: int  # bytes
    load_bps: float  # one transfer's bandwidth
    link: Link  # the tier's aggregate bandwidth, shared by every transfer through it
    hops: int  # network hops from an engine
    index: LRUIndex = field(init=False)
    evictions: int = 0

    def __post_init__(self) -> None:
        self.index = LRUIndex(self.capacity)

    def put(self, key: bytes, size: int, held: Counter) -> None:
        if key in self.index or size > self.capacity:
            if key in self.index:
                self.index.touch(key)
            return
        _, evicted = self.index.insert(key, Entry(size, None))
        held[key] += 1
        for old, _ in evicted:
            self.evictions += 1
            held[old] -= 1
            if held[old] <= 0:
                del held[old]


class FleetStore:
    """`servers[i]` is the memory tier of server i (None without one); `valkey` the shared tier (None
    without one). `held[key]`: how many tiers hold `key` (what the router's index sees)."""

    def __init__(
        self,
        num_servers: int,
        server_gib: float,
        valkey_gib: float,
        server_load_bps: float,
        server_aggregate_bps: float,
        valkey_load_bps: float,
        valkey_aggregate_bps: float,
    ) -> None:
        self.held: Counter = Counter()
        self.server_links = [Link(f"server{i}", server_aggregate_bps) for i in range(num_servers)]
        self.servers: list[Tier | None] = [
            Tier(f"server{i}", gib_bytes(server_gib), server_load_bps, self.server_links[i], 1)
            if server_gib > 0
            else None
            for i in range(num_servers)
        ]
        self.valkey: Tier | None = (
            Tier("valkey", gib_bytes(valkey_gib), valkey_load_bps, Link("valkey", valkey_aggregate_bps), 2)
            if valkey_gib > 0
            else None
        )

    @property
    def enabled(self) -> bool:
        return self.valkey is not None or any(t is not None for t in self.servers)

    def holds(self, key: bytes) -> bool:
        return key in self.held

    def leading(self, keys: list[bytes], start: int = 0) -> int:
        """How many of `keys[start:]` some tier of some server holds, in a row (the router's view)."""
        n, held = start, self.held
        while n < len(keys) and keys[n] in held:
            n += 1
        return n - start

    def lookup(self, server: int, keys: list[bytes], start: int, sizes: list[int]) -> list[Tier]:
        """The tier each of `keys[start:]` is loaded from through `server`, for the leading run found
        there or in Valkey; Valkey hits are promoted into the server's tier; every hit is touched."""
        mine, valkey = self.servers[server], self.valkey
        out: list[Tier] = []
        for i in range(start, len(keys)):
            k = keys[i]
            if mine is not None and k in mine.index:
                mine.index.touch(k)
                out.append(mine)
            elif valkey is not None and k in valkey.index:
                valkey.index.touch(k)
                out.append(valkey)
                if mine is not None:
                    mine.put(k, sizes[i], self.held)
            else:
                break
        return out

    def save(self, server: int, keys: list[bytes], sizes: list[int]) -> int:
        """Write `keys` through `server`: its tier, then Valkey. Returns the network hops per byte."""
        mine, valkey = self.servers[server], self.valkey
        for k, size in zip(keys, sizes, strict=True):
            if mine is not None:
                mine.put(k, size, self.held)
            if valkey is not None:
                valkey.put(k, size, self.held)
        return 1 + (valkey is not None)

    def evictions(self) -> int:
        return sum(t.evictions for t in [*self.servers, self.valkey] if t is not None)
