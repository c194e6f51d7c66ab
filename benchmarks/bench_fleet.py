"""What a write through the fleet's Valkey Cluster costs: the redis tier's put with and without
`wait_replicas=1` (WAIT 1: acknowledged once the primary's replica has it), on a 3 primaries +
3 replicas Cluster on loopback that this script starts and stops.

    python benchmarks/bench_fleet.py [--sizes-kib 64 1024] [--puts 300] [--rounds 3]

For each blob size, rounds alternate the two settings (the noise of a shared box hits both alike)
and time single-blob puts and batches of 8 (one pipeline per primary, plus its WAIT). Prints p50 /
p90 in ms and the WAIT/none ratio. Writes JSON to ~/.cache/kvstore/bench/fleet-wait.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.tiers.redis import RedisTier  # noqa: E402
from tests.valkey import ValkeyCluster  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_puts(tier: RedisTier, blob: bytes, n: int, batch: int) -> list[float]:
    """Seconds per put call (`batch` blobs each), fresh keys every call."""
    out = []
    for _ in range(n // batch):
        items = [(uuid.uuid4().hex, blob) for _ in range(batch)]
        t = time.perf_counter()
        if batch == 1:
            tier.put(*items[0])
        else:
            tier.put_many(items)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--puts", type=int, default=300, help="blobs per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    results = []
    with ValkeyCluster(3, replicas=1) as cluster:
        cluster.wait_replicas()
        tiers = {w: RedisTier(cluster.urls, prefix=f"b{w}:", cluster=True, wait_replicas=w) for w in (0, 1)}
        try:
            for kib in args.sizes_kib:
                blob = os.urandom(kib * 1024)
                for batch in (1, 8):
                    times: dict[int, list[float]] = {0: [], 1: []}
                    for _ in range(args.rounds):
                        for w, tier in tiers.items():
                            times[w] += time_puts(tier, blob, args.puts, batch)
                        for tier in tiers.values():  # keep memory flat between rounds
                            for k in list(tier.keys()):
                                tier.delete(k)
                    row = {"kib": kib, "batch": batch}
                    for w in (0, 1):
                        row[f"p50_ms_wait{w}"] = 1000 * statistics.median(times[w])
                        row[f"p90_ms_wait{w}"] = 1000 * pct(times[w], 0.9)
                    row["p50_ratio"] = row["p50_ms_wait1"] / row["p50_ms_wait0"]
                    results.append(row)
        finally:
            for tier in tiers.values():
                tier.close()
    print(
        f"{'blob':>8} {'batch':>5} {'p50 none':>9} {'p50 WAIT 1':>11} {'p90 none':>9} {'p90 WAIT 1':>11} {'p50 ratio':>9}"
    )
    for r in results:
        print(f"{r['kib']:>5}KiB {r['batch']:>5} {r['p50_ms_wait0']:>7.3f}ms {r['p50_ms_wait1']:>9.3f}ms "
              f"{r['p90_ms_wait0']:>7.3f}ms {r['p90_ms_wait1']:>9.3f}ms {r['p50_ratio']:>8.2f}x")  # fmt: skip
    out = Path.home() / ".cache/kvstore/bench/fleet-wait.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
