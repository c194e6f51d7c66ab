"""The redis tier against a raw redis-py (hiredis) GET/SET loop on the same Valkey, in the same run.

    python benchmarks/bench_redis.py [--sizes-kib 256 1024 4096] [--rounds 5] [--mib-per-round 64] [--cluster]

Starts its own valkey-server (or a 3-node Valkey Cluster with --cluster) on loopback and stops it.
For each blob size it times, interleaved round by round so that the noise of a shared box hits both
alike: single-key put/get (tier.put/get vs SET/GET) and batches of 8 keys (tier.put_many/get_many vs
a pipeline of 8 SETs / one MGET; on a Cluster, the cluster client's pipeline / mget_nonatomic).
Prints medians in MB/s and the ours/raw ratio. Then membership of 32 keys (what a prefix lookup
asks): `contains` key by key vs `contains_many` (one pipeline of EXISTS per server) vs a raw
pipeline of EXISTS, in µs per lookup. Writes JSON to ~/.cache/kvstore/bench/redis-<mode>.json.
`run()` is what benchmarks/bench_store.py calls.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.tiers.redis import RedisTier  # noqa: E402
from tests.valkey import ValkeyCluster, ValkeyProcess  # noqa: E402

BATCH = 8
KEYS = 16  # distinct keys cycled through, so a round never reads what it wrote a moment ago


def _rate(fn: Callable[[], object], nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e6


def bench_size(
    raw: Any, tier: RedisTier, size: int, rounds: int, mib_per_round: int
) -> dict[str, dict[str, float]]:
    blob = os.urandom(size)
    ops = max(BATCH, (mib_per_round * 2**20) // size // BATCH * BATCH)
    rkeys = [f"raw:{i:032x}" for i in range(KEYS)]
    tkeys = [f"{i:032x}" for i in range(KEYS)]
    nbytes = ops * size

    def raw_set() -> None:
        for i in range(ops):
            raw.set(rkeys[i % KEYS], blob)

    def raw_get() -> None:
        for i in range(ops):
            assert len(raw.get(rkeys[i % KEYS])) == size

    def raw_pipe_set() -> None:
        for i in range(0, ops, BATCH):
            pipe = raw.pipeline(transaction=False)
            for j in range(BATCH):
                pipe.set(rkeys[(i + j) % KEYS], blob)
            pipe.execute()

    def raw_mget() -> None:
        mget = raw.mget_nonatomic if isinstance(raw, RedisCluster) else raw.mget
        for i in range(0, ops, BATCH):
            assert len(mget([rkeys[(i + j) % KEYS] for j in range(BATCH)])) == BATCH

    def our_put() -> None:
        for i in range(ops):
            tier.put(tkeys[i % KEYS], blob)

    def our_get() -> None:
        for i in range(ops):
            assert len(tier.get(tkeys[i % KEYS])) == size

    def our_put_many() -> None:
        for i in range(0, ops, BATCH):
            tier.put_many([(tkeys[(i + j) % KEYS], blob) for j in range(BATCH)])

    def our_get_many() -> None:
        for i in range(0, ops, BATCH):
            assert all(b is not None for b in tier.get_many([tkeys[(i + j) % KEYS] for j in range(BATCH)]))

    pairs = {
        "put": (raw_set, our_put),
        "get": (raw_get, our_get),
        f"put x{BATCH}": (raw_pipe_set, our_put_many),
        f"get x{BATCH}": (raw_mget, our_get_many),
    }
    raw_set(), our_put()  # warm up (and fill the keys the gets read)
    samples: dict[str, tuple[list[float], list[float]]] = {op: ([], []) for op in pairs}
    for r in range(rounds):
        for op, (raw_fn, our_fn) in pairs.items():
            first, second = (raw_fn, our_fn) if r % 2 == 0 else (our_fn, raw_fn)
            a, b = _rate(first, nbytes), _rate(second, nbytes)
            samples[op][0].append(a if r % 2 == 0 else b)
            samples[op][1].append(b if r % 2 == 0 else a)
    assert tier.stats.errors == 0 and tier.stats.dropped_puts == 0, tier.stats
    return {
        op: {"raw_mb_s": statistics.median(r), "ours_mb_s": statistics.median(o)}
        for op, (r, o) in samples.items()
    }


def bench_lookup(raw: Any, tier: RedisTier, rounds: int, n: int = 32) -> dict[str, float]:
    """µs per membership check of `n` keys (half stored): key by key, batched, raw pipeline."""
    keys = [f"{0xE0:016x}{i:016x}" for i in range(n)]  # not bench_size's keys
    for k in keys[1::2]:
        tier.delete(k)
    tier.put_many([(k, b"x") for k in keys[::2]])
    rkeys = [tier.prefix + k for k in keys]
    want = [i % 2 == 0 for i in range(n)]

    def one_by_one() -> None:
        assert [tier.contains(k) for k in keys] == want

    def batched() -> None:
        assert tier.contains_many(keys) == want

    def raw_pipeline() -> None:
        if isinstance(raw, RedisCluster):  # the cluster client's pipeline groups by node itself
            pipe = raw.pipeline()
        else:
            pipe = raw.pipeline(transaction=False)
        for rk in rkeys:
            pipe.exists(rk)
        assert [bool(x) for x in pipe.execute()] == want

    fns = {
        "contains, key by key": one_by_one,
        f"contains_many x{n}": batched,
        f"raw EXISTS pipeline x{n}": raw_pipeline,
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(rounds, 5)):
        for name, fn in fns.items():  # interleaved: the box's noise hits all three alike
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            times[name].append((time.perf_counter() - t0) / 20 * 1e6)
    for k in keys[::2]:
        tier.delete(k)
    return {name: statistics.median(t) for name, t in times.items()}


class ManagedRedisTier(RedisTier):
    """A redis tier on a valkey-server of its own, started here and stopped by close()."""

    def __init__(self, maxmemory: int = 2**30, prefix: str = "bench:") -> None:
        self.server = ValkeyProcess().start()
        super().__init__(self.server.url, prefix=prefix, server_maxmemory=maxmemory)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.server.close()


def run(
    sizes_kib: tuple[int, ...] = (256, 1024, 4096),
    rounds: int = 5,
    mib_per_round: int = 64,
    cluster: bool = False,
) -> dict[str, Any]:
    """Start Valkey, measure, stop it; print the table and return the figures."""
    server: ValkeyProcess | ValkeyCluster
    if cluster:
        server = ValkeyCluster(3).start()
        raw: Any = RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
        tier = RedisTier(server.urls, prefix="bench:", cluster=True)
    else:
        server = ValkeyProcess(extra_args=["--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"]).start()
        raw = redis.Redis(host="127.0.0.1", port=server.port)
        tier = RedisTier(server.url, prefix="bench:")
    results: dict[str, Any] = {"mode": "cluster" if cluster else "standalone", "sizes": {}}
    try:
        print(
            f"redis tier vs raw redis-py {redis.__version__} (hiredis) on valkey, {results['mode']}; MB/s, medians of {rounds} rounds"
        )
        print(f"{'size':>8} {'op':>9} {'raw':>9} {'ours':>9} {'ours/raw':>9}")
        for kib in sizes_kib:
            figures = bench_size(raw, tier, kib * 1024, rounds, mib_per_round)
            results["sizes"][f"{kib}KiB"] = figures
            for op, f in figures.items():
                ratio = f["ours_mb_s"] / f["raw_mb_s"]
                f["ratio"] = ratio
                print(f"{kib:>5}KiB {op:>9} {f['raw_mb_s']:>9.0f} {f['ours_mb_s']:>9.0f} {ratio:>9.2f}")
        lookup = results["lookup_us"] = bench_lookup(raw, tier, rounds)
        per_key, batched, raw_us = lookup.values()
        print(
            "membership of 32 keys (µs per lookup, medians): "
            + ", ".join(f"{k} {v:.0f}" for k, v in lookup.items())
        )
        print(
            f"  contains_many is {per_key / batched:.1f}x faster than key by key, {batched / raw_us:.2f}x raw's time"
        )
    finally:
        tier.close()
        raw.close()
        server.close()
    out = Path.home() / ".cache" / "kvstore" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"redis-{results['mode']}.json").write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib-per-round", type=int, default=64)
    parser.add_argument(
        "--cluster", action="store_true", help="a 3-node Valkey Cluster instead of one server"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run(tuple(args.sizes_kib), args.rounds, args.mib_per_round, args.cluster)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
