"""Load test: 8 honest clients put/get against a kvstore-server (cpu tier + a real valkey below it)
while hostile clients attack it: slow headers, idle sockets, oversized concurrent puts, and a Redis
that hangs (SIGSTOP) every few seconds.

Checks, and prints: no honest request errors; every hit returns exactly the blob last acknowledged
for its key (an older version is a wrong blob too: honest clients replace some keys); no lost
acknowledged write (a miss of a key whose put was acknowledged in the cpu tier while fewer bytes than
its capacity were touched since, over every client, hostile ones included); the server's peak RSS
against idle + the cpu arena (capacity + slack) and its index + the body budget + the shared-memory budget (honest clients are on this
host: their blobs go through shared memory, kvstore.protocol.shm) + a stated allowance; the honest clients'
latency.

    .venv/bin/python benchmarks/load_server.py --duration 60 --clients 8 --capacity 256MiB
    .venv/bin/python benchmarks/load_server.py --no-hostile      # the same without the attackers

Then the consistency scenarios of benchmarks/consistency.py (a server restart during a Valkey outage,
`--write-policy back` with a small queue, SIGTERM mid-stream, admission, misplaced blobs), each
printing "wrong or older bytes served" and "acknowledged writes lost" (`--scenarios none` skips them,
`--scenarios-only` runs nothing else).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import multiprocessing as mp
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.sdk.remote import RemoteBackend  # noqa: E402

from benchmarks.consistency import launch  # noqa: E402
from benchmarks.hostile_clients import HostileConfig, HostileReport, run_hostile  # noqa: E402
from kvstore.config import parse_size  # noqa: E402
from kvstore.protocol.arena_table import ENTRY, slots_for  # noqa: E402
from kvstore.tiers.arena import arena_size  # noqa: E402  (the cpu tier's memory: capacity + slack)

BLOB_TOKENS = (32, 128)  # [2, 2, T, 8, 64] fp16 -> 128 KiB and 512 KiB blobs (plus a small header)
VARIANTS = 8  # distinct payloads per size; a key's payload is derived from the key and its version
# What the server may use above idle RSS + the cpu arena + the body budget: allocator slack and Python
# objects (fixed), and aiohttp's read buffer of every open connection (at most 2 x 64 KiB each).
OVERHEAD_FIXED = 96 * 2**20
PER_CONNECTION = 128 * 2**10
PUT, HIT, MISS = 0, 1, 2
REPUT = 0.05  # share of honest ops that replace a recent key with a new version
OVERSIZED = 128 * 2**20
SHM_BUDGET = 256 * 2**20  # the server's --shm-budget: 8 clients x 32 MiB segments
SHM_SEGMENT = 32 * 2**20


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


def blob_for(table: list[list[bytes]], key: str, version: int = 0) -> bytes:
    h = int(key[-8:], 16) * 2654435761 % 2**32
    return table[h % len(table)][((h >> 8) + version) % VARIANTS]


def kept(blob: bytes, key: str) -> bytes:
    """What the store keeps of `blob` (bound to no key) put under `key`: bound to it (kvstore.blob.bind_blob)."""
    from kvstore.blob import bind_blob, verify_blob  # noqa: PLC0415

    return bytes(bind_blob(blob, verify_blob(blob), key))


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (all resident memory, shared memory the process touched included) or another field of
    /proc/PID/status, such as RssShmem."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def worker(args: tuple) -> dict:
    """Random puts, replaces, gets, batches for `duration` s. Logs (time, key, bytes, kind) for the
    loss check and each op's latency."""
    from kvstore.sdk.remote import RemoteBackend  # noqa: PLC0415

    from kvstore.errors import Unavailable  # noqa: PLC0415

    wid, url, duration, table, seed = args
    rng = random.Random(seed)
    # retries off: any failure is counted, not hidden
    be = RemoteBackend(url, timeout=30, retries=0, shm_size=SHM_SEGMENT)
    log: list[tuple[float, str, int, int]] = []
    written: list[str] = []
    version: dict[str, int] = {}  # the version last acknowledged for each key
    errors: list[str] = []
    reasons: dict[str, str | None] = {}  # the store's reason for each key's latest miss
    latencies: list[float] = []
    wrong = stale = refused = 0
    n = 0
    end = time.monotonic() + duration

    def check(key: str, blob, reason: str | None = None) -> None:
        nonlocal wrong, stale
        if key not in version:
            return  # its last put failed: what it holds is not known
        if blob is None:
            if reason is None:  # a single get: ask again for the store's reason (a hit now is "gone")
                why: list[str | None] = []
                reason = "gone" if be.batch_get([key], why)[0] is not None else why[0]
            reasons[key] = reason
            log.append((time.monotonic(), key, 0, MISS, started))
            return
        data = bytes(blob)
        if data == kept(blob_for(table, key, version[key]), key):
            log.append((time.monotonic(), key, len(data), HIT, started))
        elif any(data == kept(blob_for(table, key, v), key) for v in range(version[key])):
            stale += 1  # an older version of a replaced key
        else:
            wrong += 1

    def acked(key: str, v: int, tiers: list[str]) -> None:
        version[key] = v
        if "cpu" in tiers:
            log.append((time.monotonic(), key, len(blob_for(table, key, v)), PUT, started))

    while time.monotonic() < end:
        r = rng.random()
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            if r < 0.3 or not written:
                k = key_of(wid, n)
                n += 1
                written.append(k)
                version.pop(k, None)
                acked(k, 0, be.put_blob(k, blob_for(table, k)))
            elif r < 0.3 + REPUT:  # a replace: the old version must never come back
                k = written[-1 - min(len(written) - 1, int(rng.expovariate(0.3)))]
                v = version.pop(k, 0) + 1
                acked(k, v, be.put_blob(k, blob_for(table, k, v)))
            elif r < 0.4:
                ks = [key_of(wid, n + i) for i in range(4)]
                n += 4
                written.extend(ks)
                for k, tiers in zip(ks, be.batch_put([(k, blob_for(table, k)) for k in ks]), strict=True):
                    acked(k, 0, tiers)
            elif r < 0.65:  # recent keys: should hit
                k = written[-1 - min(len(written) - 1, int(rng.expovariate(0.3)))]
                check(k, be.get_blob(k))
            elif r < 0.8:  # any key ever written: old ones are evicted by now
                k = rng.choice(written)
                check(k, be.get_blob(k))
            elif r < 0.9:
                ks = rng.sample(written, min(4, len(written)))
                why = []
                for k, b, w in zip(ks, be.batch_get(ks, why), why, strict=True):
                    check(k, b, w)
            elif r < 0.95:
                be.batch_exists(rng.sample(written, min(8, len(written))))
            else:
                be.lookup_prefix(written[-8:])
        except Unavailable as e:  # refused fast (503): counted apart from errors
            refused += 1
            errors.append(f"{type(e).__name__}: {e}")
        except Exception as e:  # the load test's job is to count every failure, of any kind
            errors.append(f"{type(e).__name__}: {e}")
        latencies.append(time.perf_counter() - t0)
    be.close()
    return {"log": log, "errors": errors, "wrong": wrong, "stale": stale, "refused": refused, "reasons": reasons,
            "latencies": latencies}  # fmt: skip


def find_lost(logs: list[list[tuple]], capacity: int, reasons: dict | None = None) -> list[str]:
    """Misses of acknowledged writes that no amount of eviction explains.

    Every event is (end, key, bytes, kind, start): a request may have stored, promoted or touched its
    blobs at any moment between its start and its end. LRU can only have evicted a key between its
    last acknowledged put into the cpu tier and a miss if at least `capacity` bytes of other blobs
    were put or read (touched) in between, over every client, hostile ones included. Counting every
    put or hit that overlaps that window at all (end after the put's start, start before the miss's
    end) bounds those bytes from above, so a miss with less than that is a write the store lost."""
    events = sorted(e for log in logs for e in log)
    touching = [e for e in events if e[3] in (PUT, HIT)]
    ends = [e[0] for e in touching]  # sorted
    after_end = list(itertools.accumulate(reversed([e[2] for e in touching]), initial=0))[::-1]
    by_start = sorted((e[4], e[2]) for e in touching)
    starts = [s for s, _ in by_start]
    after_start = list(itertools.accumulate(reversed([n for _, n in by_start]), initial=0))[::-1]
    last_put: dict[str, tuple[float, int]] = {}  # key -> (start, bytes) of its last acknowledged put
    lost = []
    for end, key, nbytes, kind, start in events:
        if kind == PUT:
            last_put[key] = (start, nbytes)
        elif kind == MISS and key in last_put:
            put_start, size = last_put[key]
            since = (
                after_end[bisect.bisect_right(ends, put_start)] - after_start[bisect.bisect_left(starts, end)]
            )
            since -= size  # its own put is one of the events counted
            if since < capacity - size:
                why = (reasons or {}).get(key)
                lost.append(f"{key}: missed ({why}) after at most {since} bytes touched since its put")
    return lost


def start_valkey() -> object:
    from tests.valkey import ValkeyProcess  # noqa: PLC0415

    return ValkeyProcess(extra_args=["--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"]).start()


def start_server(capacity: int, budget: int, redis_url: str | None) -> tuple[subprocess.Popen, str]:
    tiers = ["--tiers", "cpu,redis", "--redis-url", redis_url] if redis_url else ["--tiers", "cpu"]
    return launch([*tiers, "--cpu-capacity", str(capacity), "--max-blob-size", "160MiB",
                   "--max-body-bytes-in-flight", str(budget), "--shm-budget", str(SHM_BUDGET)])  # fmt: skip


def oversized_blob(nbytes: int) -> bytes:
    """A valid blob of about `nbytes` (made before any fork: torch in a forked child can deadlock)."""
    import torch  # noqa: PLC0415

    from kvstore.blob import encode_blob  # noqa: PLC0415

    return encode_blob(torch.zeros(2, 2, nbytes // (2 * 2 * 8 * 256 * 2), 8, 256, dtype=torch.float16))


def _hostile_process(port: int, duration: float, cfg: HostileConfig, blob: bytes, out: mp.Queue) -> None:
    out.put(run_hostile(port, duration, cfg, blob))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_load(duration: float, clients: int, capacity: int, budget: int, hostile: bool) -> dict:
    table = blob_table()
    oversized = min(OVERSIZED, capacity // 2)  # far over the honest blobs, still fits the cpu tier
    big = oversized_blob(oversized) if hostile else b""
    valkey = start_valkey()
    server, url = start_server(capacity, budget, valkey.url)  # type: ignore[attr-defined]
    port = int(url.rsplit(":", 1)[1])
    samples: list[int] = []
    shm_samples: list[int] = []  # the part of RSS that is shared memory the server touched
    spill_samples: list[int] = [0]
    stop = threading.Event()
    ctx = mp.get_context("fork")
    hostile_out: mp.Queue = ctx.Queue()
    cfg = HostileConfig(
        oversized_bytes=oversized,
        redis_pid=valkey.proc.pid,  # type: ignore[attr-defined]
        redis_hang_s=min(8.0, duration / 6),
        redis_run_s=min(12.0, duration / 4),
    )
    try:
        time.sleep(0.5)
        idle = rss_bytes(server.pid)

        def sample() -> None:  # (RemoteBackend is imported before: a fork amid an import would hang)
            with RemoteBackend(url, transport="http") as be:
                while not stop.is_set():
                    samples.append(rss_bytes(server.pid))
                    shm_samples.append(rss_bytes(server.pid, "RssShmem"))
                    if len(samples) % 5 == 0:  # blobs the cpu tier keeps outside its arena: part of the bound
                        spill_samples.append(be.stats()["tiers"][0]["spilled_bytes"])
                    stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        attacker = ctx.Process(
            target=_hostile_process, args=(port, duration, cfg, big, hostile_out), daemon=True
        )
        if hostile:
            attacker.start()
        start = time.monotonic()
        with ctx.Pool(clients) as pool:
            results = pool.map(worker, [(w, url, duration, table, w) for w in range(clients)])
        wall = time.monotonic() - start
        rep = hostile_out.get(timeout=180) if hostile else HostileReport()
        if hostile:
            attacker.join(30)
        stop.set()
        sampler.join()
        with RemoteBackend(url, transport="http") as be:
            stats = be.stats()
    finally:
        server.terminate()
        server.wait(60)
        valkey.close()  # type: ignore[attr-defined]
    logs = [r["log"] for r in results] + [rep.log]
    reasons = {k: v for r in results for k, v in r["reasons"].items()}
    lost = find_lost(logs, capacity, reasons)
    honest = [e for r in results for e in r["log"]]
    latencies = [x for r in results for x in r["latencies"]]
    connections = clients + (cfg.slow_headers + cfg.idle_sockets + cfg.oversized_threads if hostile else 0)
    allowance = OVERHEAD_FIXED + connections * PER_CONNECTION
    table = slots_for(capacity) * ENTRY  # where each arena blob lies, for same-host clients
    bound = idle + arena_size(capacity) + table + max(spill_samples) + budget + SHM_BUDGET + allowance
    rss_max = max(samples) if samples else idle
    cpu = stats["tiers"][0]
    return {
        "duration_s": round(wall, 1),
        "clients": clients,
        "hostile": hostile,
        "capacity": capacity,
        "budget": budget,
        "ops": len(latencies),
        "ops_per_s": round(len(latencies) / wall),
        "acked_puts": sum(1 for e in honest if e[3] == PUT),
        "gets_hit": sum(1 for e in honest if e[3] == HIT),
        "gets_miss": sum(1 for e in honest if e[3] == MISS),
        "errors": sum(len(r["errors"]) for r in results),
        "refused": sum(r["refused"] for r in results),
        "error_samples": [e for r in results for e in r["errors"]][:5],
        "wrong_blobs": sum(r["wrong"] for r in results),
        "stale_blobs": sum(r["stale"] for r in results),
        "lost_writes": len(lost),
        "lost_samples": lost[:5],
        "evictions": cpu["evictions"],
        "stored_bytes": cpu["bytes"],
        "invalidated_in_redis": stats["tiers"][1].get("invalidated", 0) if len(stats["tiers"]) > 1 else 0,
        "latency_p50_ms": round(percentile(latencies, 0.5) * 1e3, 2),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
        "latency_max_ms": round(max(latencies, default=0) * 1e3, 1),
        "rss_idle": idle,
        "rss_max": rss_max,
        "rss_shm_max": max(shm_samples, default=0),
        "shm_segments_end": stats["server"].get("shm", {}).get("segments", 0),
        "rss_spilled_max": max(spill_samples),
        "rss_bound": bound,
        "rss_allowance": allowance,
        "rss_within_bound": rss_max <= bound,
        "hostile_report": {k: v for k, v in vars(rep).items() if k != "log"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--capacity", default="256MiB", help="the server's cpu tier capacity")
    ap.add_argument("--budget", default="512MiB", help="the server's --max-body-bytes-in-flight")
    ap.add_argument("--no-hostile", dest="hostile", action="store_false", help="honest clients only")
    ap.add_argument("--scenarios", default="all", help="consistency scenarios after the load: all, none, "
                    "or a comma list of restart,back,sigterm,sigterm-drop,admission,misplaced")  # fmt: skip
    ap.add_argument("--scenarios-only", action="store_true", help="run the scenarios, not the load")
    args = ap.parse_args()
    from benchmarks.consistency import SCENARIOS, report, run_scenarios  # noqa: PLC0415

    names = (
        []
        if args.scenarios == "none"
        else list(SCENARIOS)
        if args.scenarios == "all"
        else args.scenarios.split(",")
    )
    if set(names) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(set(names) - set(SCENARIOS))}")
    if args.scenarios_only:
        sys.exit(0 if report(run_scenarios(names)) else 1)
    r = run_load(
        args.duration, args.clients, parse_size(args.capacity), parse_size(args.budget), args.hostile
    )
    mib = 2**20
    who = "beside hostile clients" if r["hostile"] else "alone"
    print(f"{r['clients']} honest clients x {r['duration_s']} s {who}; cpu tier {r['capacity'] / mib:.0f} MiB "
          f"over valkey, body budget {r['budget'] / mib:.0f} MiB")  # fmt: skip
    print(f"  honest ops {r['ops']} ({r['ops_per_s']}/s), puts acknowledged {r['acked_puts']}")
    print(f"  gets: {r['gets_hit']} hits, {r['gets_miss']} misses; cpu evictions {r['evictions']}")
    print(f"  wrong blobs {r['wrong_blobs']} (older versions {r['stale_blobs']})  "
          f"acknowledged-but-lost writes {r['lost_writes']}  errors {r['errors']} (503 refused {r['refused']})")  # fmt: skip
    print(
        f"  honest latency p50 {r['latency_p50_ms']} ms, p99 {r['latency_p99_ms']} ms, max {r['latency_max_ms']} ms"
    )
    print(f"  server RSS: idle {r['rss_idle'] / mib:.0f} MiB, peak {r['rss_max'] / mib:.0f} MiB (shared memory "
          f"{r['rss_shm_max'] / mib:.0f} MiB of it); bound idle + cpu arena + spilled {r['rss_spilled_max'] / mib:.0f} MiB + budget + shm budget "
          f"{SHM_BUDGET / mib:.0f} + {r['rss_allowance'] / mib:.0f} MiB = {r['rss_bound'] / mib:.0f} MiB -> "
          f"{'OK' if r['rss_within_bound'] else 'EXCEEDED'}")  # fmt: skip
    if r["hostile"]:
        h = r["hostile_report"]
        print(f"  hostile: slow headers closed with 408 {h['slow_closed_408']} (other {h['slow_closed_other']}), "
              f"idle sockets closed {h['idle_closed']}, connections refused 503 {h['refused_503']}, "
              f"oversized puts {h['oversized']}, redis hangs {h['redis_hangs']}")  # fmt: skip
    for sample in r["error_samples"] + r["lost_samples"]:
        print("   ", sample)
    out = Path.home() / ".cache" / "kvstore" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"load_server{'_hostile' if r['hostile'] else ''}.json").write_text(json.dumps(r, indent=1))
    ok = not r["errors"] and not r["wrong_blobs"] and not r["stale_blobs"] and not r["lost_writes"]
    consistent = report(run_scenarios(names)) if names else True
    sys.exit(0 if ok and consistent and r["rss_within_bound"] else 1)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
