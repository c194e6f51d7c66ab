"""Load test: N client processes put/get against a kvstore-server whose cpu tier has a fixed capacity.

Checks, and prints: no request errors; every hit returns exactly the blob that was written; no lost
acknowledged write (a miss of a key that was acknowledged while fewer bytes than the capacity were
touched since, in any client, is a lost write); the server's RSS stays within its idle RSS + capacity
+ a stated overhead.

    .venv/bin/python benchmarks/load_server.py --duration 60 --clients 8 --capacity 256MiB
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.config import parse_size  # noqa: E402

BLOB_TOKENS = (32, 128)  # [2, 2, T, 8, 64] fp16 -> 128 KiB and 512 KiB blobs (plus a small header)
VARIANTS = 8  # distinct payloads per size; a key's payload is derived from the key
# Overhead the server may use above idle RSS + capacity: request bodies in flight (each client's
# largest request, received and joined once) plus allocator slack. Stated, measured, asserted.
OVERHEAD_FIXED = 96 * 2**20
PUT, HIT, MISS = 0, 1, 2


def blob_table() -> list[list[bytes]]:
    import torch  # noqa: PLC0415

    from kvstore.blob import encode_blob  # noqa: PLC0415

    out = []
    for t in BLOB_TOKENS:
        g = torch.Generator().manual_seed(t)
        out.append([encode_blob(torch.randn(2, 2, t, 8, 64, generator=g).half()) for _ in range(VARIANTS)])
    return out


def key_of(worker: int, n: int) -> str:
    return f"{worker:04x}{n:028x}"


def blob_for(table: list[list[bytes]], key: str) -> bytes:
    h = int(key[-8:], 16) * 2654435761 % 2**32
    return table[h % len(table)][(h >> 8) % VARIANTS]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def worker(args: tuple) -> dict:
    """Random puts, gets, batches for `duration` s. Logs (time, key, bytes, kind) for the loss check."""
    from sdk.remote import RemoteBackend  # noqa: PLC0415

    wid, url, duration, table, seed = args
    rng = random.Random(seed)
    be = RemoteBackend(url, timeout=30, retries=0)  # retries off: any failure is counted, not hidden
    log: list[tuple[float, str, int, int]] = []
    written: list[str] = []
    errors: list[str] = []
    wrong = 0
    n = 0
    ops = 0
    end = time.monotonic() + duration

    def check(key: str, blob) -> None:
        nonlocal wrong
        if blob is None:
            log.append((time.monotonic(), key, 0, MISS))
        elif bytes(blob) != blob_for(table, key):
            wrong += 1
        else:
            log.append((time.monotonic(), key, len(blob), HIT))

    while time.monotonic() < end:
        r = rng.random()
        try:
            if r < 0.3 or not written:
                k = key_of(wid, n)
                n += 1
                be.put_blob(k, blob_for(table, k))
                log.append((time.monotonic(), k, len(blob_for(table, k)), PUT))
                written.append(k)
            elif r < 0.4:
                ks = [key_of(wid, n + i) for i in range(4)]
                n += 4
                be.batch_put([(k, blob_for(table, k)) for k in ks])
                t = time.monotonic()
                log.extend((t, k, len(blob_for(table, k)), PUT) for k in ks)
                written.extend(ks)
            elif r < 0.65:  # recent keys: should hit
                k = written[-1 - min(len(written) - 1, int(rng.expovariate(0.3)))]
                check(k, be.get_blob(k))
            elif r < 0.8:  # any key ever written: old ones are evicted by now
                k = rng.choice(written)
                check(k, be.get_blob(k))
            elif r < 0.9:
                ks = rng.sample(written, min(4, len(written)))
                for k, b in zip(ks, be.batch_get(ks), strict=True):
                    check(k, b)
            elif r < 0.95:
                be.batch_exists(rng.sample(written, min(8, len(written))))
            else:
                be.lookup_prefix(written[-8:])
            ops += 1
        except Exception as e:  # the load test's job is to count every failure, of any kind
            errors.append(f"{type(e).__name__}: {e}")
    be.close()
    return {"log": log, "errors": errors, "wrong": wrong, "ops": ops}


def find_lost(logs: list[list[tuple]], capacity: int, slack: int) -> list[str]:
    """Misses of acknowledged writes that no amount of eviction explains.

    Between a key's last acknowledged put and a miss of it, LRU can only have evicted it if at least
    `capacity - slack` bytes of other blobs were put or read (touched) in between, counted over every
    client. The sum over all touches bounds the distinct bytes touched from above, so a miss with
    less than that is a write the store lost."""
    events = sorted(e for log in logs for e in log)
    touched = [0]
    for e in events:
        touched.append(touched[-1] + (e[2] if e[3] in (PUT, HIT) else 0))
    last_put: dict[str, int] = {}
    lost = []
    for i, (_, key, _, kind) in enumerate(events):
        if kind == PUT:
            last_put[key] = i
        elif kind == MISS and key in last_put:
            since = touched[i] - touched[last_put[key] + 1]
            if since < capacity - slack:
                lost.append(f"{key}: missed after only {since} bytes touched since its put")
    return lost


def start_server(capacity: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "server", "--tiers", "cpu", "--cpu-capacity", str(capacity), "--port", "0",
           "--max-blob-size", "4MiB", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[-1]


def run_load(duration: float, clients: int, capacity: int) -> dict:
    table = blob_table()
    biggest = max(len(b) for row in table for b in row)
    server, url = start_server(capacity)
    samples: list[int] = []
    stop = threading.Event()
    try:
        time.sleep(0.5)
        idle = rss_bytes(server.pid)

        def sample() -> None:
            while not stop.is_set():
                samples.append(rss_bytes(server.pid))
                stop.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        with mp.get_context("fork").Pool(clients) as pool:
            results = pool.map(worker, [(w, url, duration, table, w) for w in range(clients)])
        wall = time.monotonic() - start
        stop.set()
        sampler.join()
        from sdk.remote import RemoteBackend  # noqa: PLC0415

        with RemoteBackend(url) as be:
            stats = be.stats()
    finally:
        server.terminate()
        server.wait(60)
    logs = [r["log"] for r in results]
    slack = clients * 4 * biggest  # puts in flight (a batch of 4 per client) when a miss is logged
    lost = find_lost(logs, capacity, slack)
    puts = sum(1 for log in logs for e in log if e[3] == PUT)
    put_bytes = sum(e[2] for log in logs for e in log if e[3] == PUT)
    hits = sum(1 for log in logs for e in log if e[3] == HIT)
    misses = sum(1 for log in logs for e in log if e[3] == MISS)
    allowance = OVERHEAD_FIXED + clients * 4 * biggest
    return {
        "duration_s": round(wall, 1),
        "clients": clients,
        "capacity": capacity,
        "ops": sum(r["ops"] for r in results),
        "ops_per_s": round(sum(r["ops"] for r in results) / wall),
        "put_MBps": round(put_bytes / wall / 1e6, 1),
        "acked_puts": puts,
        "gets_hit": hits,
        "gets_miss": misses,
        "errors": sum(len(r["errors"]) for r in results),
        "error_samples": [e for r in results for e in r["errors"]][:5],
        "wrong_blobs": sum(r["wrong"] for r in results),
        "lost_writes": len(lost),
        "lost_samples": lost[:5],
        "evictions": stats["tiers"][0]["evictions"],
        "stored_bytes": stats["tiers"][0]["bytes"],
        "rss_idle": idle,
        "rss_max": max(samples) if samples else idle,
        "rss_allowance": allowance,
        "rss_within_bound": (max(samples) if samples else idle) <= idle + capacity + allowance,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--capacity", default="256MiB", help="the server's cpu tier capacity")
    args = ap.parse_args()
    r = run_load(args.duration, args.clients, parse_size(args.capacity))
    mib = 2**20
    print(f"{r['clients']} clients x {r['duration_s']} s against a {r['capacity'] / mib:.0f} MiB cpu tier")
    print(
        f"  ops {r['ops']} ({r['ops_per_s']}/s), puts acknowledged {r['acked_puts']} ({r['put_MBps']} MB/s)"
    )
    print(f"  gets: {r['gets_hit']} hits, {r['gets_miss']} misses; evictions {r['evictions']}")
    print(
        f"  errors {r['errors']}  wrong blobs {r['wrong_blobs']}  lost acknowledged writes {r['lost_writes']}"
    )
    print(f"  server RSS: idle {r['rss_idle'] / mib:.0f} MiB, max {r['rss_max'] / mib:.0f} MiB; bound idle + "
          f"capacity + {r['rss_allowance'] / mib:.0f} MiB = {(r['rss_idle'] + r['capacity'] + r['rss_allowance']) / mib:.0f}"
          f" MiB -> {'OK' if r['rss_within_bound'] else 'EXCEEDED'}")  # fmt: skip
    for sample in r["error_samples"] + r["lost_samples"]:
        print("   ", sample)
    out = Path.home() / ".cache" / "kvstore" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_server.json").write_text(json.dumps(r, indent=1))
    ok = not r["errors"] and not r["wrong_blobs"] and not r["lost_writes"] and r["rss_within_bound"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
