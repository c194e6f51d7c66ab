"""Store throughput next to plain memcpy, measured side by side in one process.

    make bench            (or: PYTHONPATH=. .venv/bin/python benchmarks/bench_store.py --reps 5)

Per tier and chunk size: put and get GB/s of `Tier.put` / `Tier.get` on real blobs, and their ratio to
memcpy (`np.copyto` of the same blobs' payloads into a prefaulted buffer), measured right before each
row so both see the same data and the same machine load. Then the store level: `get_blob` (lookup + checksum verification) and the
SDK's `Store.get` decoded into a tensor, fresh or preallocated (`out=`).
To add a tier (e.g. redis), add a factory to TIER_FACTORIES; `bench_tier` does the rest.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from kvstore.sdk import Store

from kvstore.blob import HEADER_SIZE, encode_blob
from kvstore.config import parse_size
from kvstore.tiers.base import Tier
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier

try:  # run as a script, benchmarks/ is on sys.path
    from bench_redis import ManagedRedisTier
    from bench_redis import run as bench_redis_vs_raw
except ImportError:  # imported as benchmarks.bench_store
    from benchmarks.bench_redis import ManagedRedisTier
    from benchmarks.bench_redis import run as bench_redis_vs_raw

GB = 1e9
TOTAL_BYTES = 32 * 2**20  # data moved per run and size


@dataclass
class Row:
    tier: str
    size: int
    put_s: float  # median seconds per blob
    get_s: float
    memcpy_gbps: float

    @property
    def put_gbps(self) -> float:
        return self.size / self.put_s / GB

    @property
    def get_gbps(self) -> float:
        return self.size / self.get_s / GB


def memcpy_gbps(blobs: list[bytes], size: int, reps: int) -> float:
    """np.copyto of each blob's payload into one prefaulted buffer: the ceiling for moving this data set."""
    srcs = [np.frombuffer(b, dtype=np.uint8, count=size, offset=HEADER_SIZE) for b in blobs]
    dst = np.ones(size, dtype=np.uint8)  # written once: prefaulted
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for src in srcs:
            np.copyto(dst, src)
        times.append((time.perf_counter() - t0) / len(srcs))
    return size / statistics.median(times) / GB


def make_blobs(size: int, count: int) -> list[bytes]:
    """`count` distinct raw float16 blobs whose payload is `size` bytes ([2, 1, size/256, 1, 64])."""
    g = torch.Generator().manual_seed(size)
    return [encode_blob(torch.randn(2, 1, size // 256, 1, 64, generator=g).half()) for _ in range(count)]


def _keys(size: int, n: int) -> list[str]:
    return [f"{size:016x}{i:016x}" for i in range(n)]


def bench_tier(tier: Tier, sizes: list[int], reps: int) -> list[Row]:
    """Put then get TOTAL_BYTES of distinct blobs per size; median time per blob over `reps` runs."""
    rows = []
    for size in sizes:
        blobs = make_blobs(size, max(2, TOTAL_BYTES // size))
        keys = _keys(size, len(blobs))
        memcpy = memcpy_gbps(blobs, size, reps)
        puts, gets = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for k, b in zip(keys, blobs, strict=True):
                tier.put(k, b)
            puts.append((time.perf_counter() - t0) / len(keys))
            t0 = time.perf_counter()
            for k in keys:
                if tier.get(k) is None:
                    raise RuntimeError(f"{tier.name} lost {k}")
            gets.append((time.perf_counter() - t0) / len(keys))
        for k in keys:
            tier.delete(k)
        rows.append(Row(tier.name, size, statistics.median(puts), statistics.median(gets), memcpy))
    return rows


def bench_store_get(sizes: list[int], reps: int) -> list[tuple[int, float, float, float, float]]:
    """Reads through the SDK over a cpu-tier store: (size, get_blob, get, get(out=), memcpy) in GB/s."""
    rows = []
    with Store.local(tiers=["cpu"], cpu_capacity=2 * TOTAL_BYTES + 2**26) as store:
        for size in sizes:
            blobs = make_blobs(size, max(2, TOTAL_BYTES // size))
            keys = _keys(size, len(blobs))
            store.batch_put(list(zip(keys, blobs, strict=True)))
            out = torch.empty(2, 1, size // 256, 1, 64, dtype=torch.float16)
            memcpy = memcpy_gbps(blobs, size, reps)
            runs: dict[str, list[float]] = {"blob": [], "fresh": [], "out": []}
            for _ in range(reps):
                for name, fn in (
                    ("blob", store.get_blob),
                    ("fresh", store.get),
                    ("out", lambda k, out=out: store.get(k, out=out)),
                ):
                    t0 = time.perf_counter()
                    for k in keys:
                        fn(k)
                    runs[name].append((time.perf_counter() - t0) / len(keys))
            for k in keys:
                store.delete(k)
            gbps = {n: size / statistics.median(t) / GB for n, t in runs.items()}  # KV payload bytes
            rows.append((size, gbps["blob"], gbps["fresh"], gbps["out"], memcpy))
    return rows


TIER_FACTORIES: dict[str, Callable[[Path], Tier]] = {
    "cpu": lambda tmp: CpuTier(2 * TOTAL_BYTES + 2**26, memory="plain"),
    "disk": lambda tmp: DiskTier(tmp / "disk", 2 * TOTAL_BYTES + 2**26),
    "disk-nofsync": lambda tmp: DiskTier(tmp / "disk-nofsync", 2 * TOTAL_BYTES + 2**26, fsync=False),
    "redis": lambda tmp: ManagedRedisTier(),  # its own valkey-server, stopped by close()
}


TIER_NOTES: dict[str, str] = {
    "cpu": "put keeps and get returns the caller's immutable bytes object (zero-copy), so no bytes move.",
    "disk": "put = write + fsync(file) + rename + fsync(dir); get = read from the page cache.",
    "disk-nofsync": "put = write + rename (no fsync); get = read from the page cache.",
    "redis": "a local valkey-server over loopback TCP (get = GET, put = SET of the whole blob).",
}


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description="kvstore tier and store throughput vs memcpy")
    ap.add_argument("--tiers", default=",".join(TIER_FACTORIES))
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    unknown = set(args.tiers.split(",")) - set(TIER_FACTORIES)
    if unknown:
        ap.error(f"unknown tiers {sorted(unknown)}; known: {', '.join(TIER_FACTORIES)}")

    print(
        f"median of {args.reps} runs, {TOTAL_BYTES >> 20} MiB per run; GB/s = 1e9 B/s; memcpy measured per row\n"
    )
    print(f"{'tier':<13}{'chunk':>8}{'put µs':>10}{'get µs':>10}{'put GB/s':>10}{'get GB/s':>10}"
          f"{'memcpy':>8}{'put/memcpy':>12}{'get/memcpy':>12}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        for name in args.tiers.split(","):
            tier = TIER_FACTORIES[name](Path(tmp))
            tier.name = name
            try:
                for r in bench_tier(tier, sizes, args.reps):
                    print(f"{r.tier:<13}{_size(r.size):>8}{r.put_s * 1e6:10.1f}{r.get_s * 1e6:10.1f}"
                          f"{r.put_gbps:10.2f}{r.get_gbps:10.2f}{r.memcpy_gbps:8.2f}"
                          f"{r.put_gbps / r.memcpy_gbps:12.1f}x{r.get_gbps / r.memcpy_gbps:11.1f}x")  # fmt: skip
            finally:
                tier.close()
    selected = args.tiers.split(",")
    for name in selected:  # what each measured tier's row means; nothing about tiers not measured
        if name in TIER_NOTES:
            print(f"{name}: {TIER_NOTES[name]}")
    print()
    if "redis" in selected:
        bench_redis_vs_raw(tuple(s // 1024 for s in sizes), rounds=max(3, args.reps))
        print()

    print("store level, cpu tier, through the SDK (GB/s of KV payload):")
    print(f"{'chunk':>8}{'get_blob':>10}{'get':>10}{'get(out=)':>11}{'memcpy':>8}{'get(out=)/memcpy':>18}")
    for size, g_blob, g_fresh, g_out, memcpy in bench_store_get(sizes, args.reps):
        print(
            f"{_size(size):>8}{g_blob:10.2f}{g_fresh:10.2f}{g_out:11.2f}{memcpy:8.2f}{g_out / memcpy:17.0%}"
        )
    print("get_blob = lookup + xxh3 checksum of the blob; get = that + decode into a fresh tensor;")
    print("get(out=) = into a preallocated tensor: two passes over the data (checksum, then copy), so about")
    print("half of memcpy is the ceiling when chunks come from RAM rather than cache.")


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
