"""kvstore-server (HTTP, sdk.remote.RemoteBackend) next to raw redis-py on Valkey, same machine, same run.

For 256 KiB / 1 MiB / 4 MiB chunks: get and put, single keys and batches of 8 (Valkey: MGET / MSET),
1 and 8 client processes. Prints MB/s, p50/p99 latency per call and the kvstore/Valkey throughput ratio.
Each cell runs kvstore and Valkey alternately `--repeats` times and keeps each one's best run, so that
both see the same background load (this box is shared and noisy).

    .venv/bin/python benchmarks/bench_server.py            # full table, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_server.py --quick    # 1 MiB only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.blob import encode_blob  # noqa: E402
from sdk.remote import RemoteBackend  # noqa: E402
from tests.valkey import ValkeyProcess  # noqa: E402

SIZES = {"256KiB": 32, "1MiB": 128, "4MiB": 512}  # tokens of a [2, 4, T, 8, 64] fp16 chunk
OUT = Path.home() / ".cache" / "kvstore" / "bench"


def make_blob(tokens: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 4, tokens, 8, 64, generator=g).half())


def start_server(capacity: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "server", "--tiers", "cpu", "--cpu-capacity", capacity, "--port", "0"]
    proc = subprocess.Popen(cmd + ["--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"kvstore-server did not start: {line!r}")
    return proc, line.split()[-1]


def _worker(args: tuple) -> tuple[int, list[float]]:
    """One client process: `calls` timed calls; returns bytes moved and per-call latencies."""
    system, target, op, batch, blob, wid, calls = args
    keys = [f"{wid:08x}{i:024x}" for i in range(2 * batch)]
    if system == "kvstore":
        be = RemoteBackend(target)
        put1, get1 = be.put_blob, be.get_blob

        def putb(ks: list[str]) -> None:
            be.batch_put([(k, blob) for k in ks])

        getb = be.batch_get
    else:
        import redis  # noqa: PLC0415

        r = redis.Redis.from_url(target)
        put1, get1 = r.set, r.get

        def putb(ks: list[str]) -> None:
            r.mset({k: blob for k in ks})

        getb = r.mget
    for k in keys:  # the keys a get reads exist; a put overwrites them
        put1(k, blob)
    groups = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    lat = []
    moved = 0
    for i in range(calls):
        ks = groups[i % len(groups)]
        t = time.perf_counter()
        if op == "get":
            got = get1(ks[0]) if batch == 1 else getb(ks)
            n = len(got) if batch == 1 else sum(len(x) for x in got)
        else:
            put1(ks[0], blob) if batch == 1 else putb(ks)
            n = len(blob) * len(ks)
        lat.append(time.perf_counter() - t)
        moved += n
    if system == "kvstore":
        be.close()
    return moved, lat


def run_cell(pool_ctx, system: str, target: str, op: str, batch: int, clients: int, blob: bytes, budget: int):
    calls = max(4, budget // (len(blob) * batch * clients))
    args = [(system, target, op, batch, blob, w, calls) for w in range(clients)]
    start = time.perf_counter()
    if clients == 1:
        results = [_worker(args[0])]
    else:
        with pool_ctx.Pool(clients) as pool:
            start = time.perf_counter()  # the pool is up; setup puts are inside, as for one client
            results = pool.map(_worker, args)
    wall = time.perf_counter() - start
    moved = sum(m for m, _ in results)
    lat = sorted(x for _, ls in results for x in ls)
    return {
        "MBps": moved / wall / 1e6,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 MiB chunks only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=96, help="bytes moved per cell run")
    ap.add_argument("--clients", default="1,8")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = {"1MiB": SIZES["1MiB"]} if args.quick else SIZES
    client_counts = [int(c) for c in args.clients.split(",")]
    ctx = mp.get_context("fork")
    server, url = start_server("2GiB")
    valkey = ValkeyProcess().start()
    rows = []
    try:
        for size_name, tokens in sizes.items():
            blob = make_blob(tokens, 0)
            for op in ("get", "put"):
                for batch in (1, 8):
                    for clients in client_counts:
                        best: dict[str, dict] = {}
                        for _ in range(args.repeats):
                            for system, target in (("kvstore", url), ("valkey", valkey.url)):
                                r = run_cell(
                                    ctx, system, target, op, batch, clients, blob, args.budget_mib << 20
                                )
                                if system not in best or r["MBps"] > best[system]["MBps"]:
                                    best[system] = r
                        row = {"size": size_name, "op": op, "batch": batch, "clients": clients, **{
                            f"{s}_{k}": v for s, r in best.items() for k, v in r.items()
                        }}  # fmt: skip
                        row["ratio"] = row["kvstore_MBps"] / row["valkey_MBps"]
                        rows.append(row)
                        print_row(row, header=len(rows) == 1)
    finally:
        server.terminate()
        server.wait(30)
        valkey.close()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_server.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {OUT / 'bench_server.json'}")


def print_row(row: dict, header: bool) -> None:
    if header:
        print(
            f"{'size':>7} {'op':>4} {'batch':>5} {'cli':>3} | {'kvstore MB/s':>12} {'p50 ms':>7} {'p99 ms':>7} | "
            f"{'valkey MB/s':>11} {'p50 ms':>7} {'p99 ms':>7} | {'ratio':>5}"
        )
    print(
        f"{row['size']:>7} {row['op']:>4} {row['batch']:>5} {row['clients']:>3} | "
        f"{row['kvstore_MBps']:>12.0f} {row['kvstore_p50_ms']:>7.2f} {row['kvstore_p99_ms']:>7.2f} | "
        f"{row['valkey_MBps']:>11.0f} {row['valkey_p50_ms']:>7.2f} {row['valkey_p99_ms']:>7.2f} | "
        f"{row['ratio']:>5.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
