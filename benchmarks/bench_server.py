"""kvstore-server next to Valkey (redis-py + hiredis) and memcpy: same machine, same run, one client.

Blobs of 256 KiB / 1 MiB / 4 MiB, and of real chunks (`--sizes` 6MiB: a SmolLM2 chunk of 256 tokens is
5.9 MB; 32MiB: a Llama-3-8B one is 33.5 MB); single get and put, batches of 8 (Valkey: MGET / MSET); kvstore
over each transport of `kvstore.sdk.remote.RemoteBackend`:
    http       HTTP/1.1 (the public API)
    tcp        the binary data plane on the same port (kvstore.protocol.dataplane)
    shm        the data plane with blobs in shared memory (kvstore.protocol.shm), over the server's Unix
               socket: a put through the client's segment; a get copies the blob out of the
               server's cpu arena where its index says it lies, without a request
               (kvstore.protocol.arena_table), into a buffer the caller owns, as redis-py's GET does
    shm-lease  the same get into the SDK's reused buffers (a lease), verified (xxh3) before use: by
               the SDK as it copies, which the lease's `headers` say, else by the caller; what the
               engines' connectors do with a loaded chunk
    shm-lent   a lease without the index (`read_index=False`): the server answers where the blob
               lies in its arena and lends it there (no copy), verified before the lease ends
    shm-inplace  a lease `in_place=True` (what the connectors ask for): views of the arena where the
               index says the blobs lie, no request and no copy, verified, then `intact()` checked
    memcpy     np.copyto of the same bytes between prefaulted buffers: the machine's ceiling
Keys are distinct: gets walk a pool of stored keys larger than the CPU caches, puts overwrite a pool
of keys in order; each key's blob is bound to it (`kvstore.blob.bind_blob`, as the connectors put
them, so the server stores what it is sent and binds no copy) and the client sends from distinct
source buffers. Before the timed rounds each system
reads the whole pool once (a long-running client has touched the server's arena pages before: the
first read of a page of a shared mapping costs a page fault in the reader). Every round runs each system once per
cell, in an order that rotates from round to round, so all of them see the same background load (the
box is shared). Printed: the median MB/s of each system and, per kvstore transport, the median of its
per-round ratios to Valkey with their min-max; then the figures the design asks for.

    .venv/bin/python benchmarks/bench_server.py                 # ~2-4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_server.py --sizes 1MiB --rounds 3
    .venv/bin/python benchmarks/bench_server.py --sizes 6MiB,32MiB --budget-mib 256 --pool-mib 2200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.sdk.remote import RemoteBackend  # noqa: E402

from kvstore.blob import bind_blob, encode_blob, verify_blob  # noqa: E402
from tests.valkey import ValkeyProcess  # noqa: E402

SIZES = {
    "256KiB": 32,
    "1MiB": 128,
    "4MiB": 512,
    "6MiB": 720,
    "32MiB": 4096,
}  # tokens of [2, 4, T, 8, 64] fp16
OUT = Path.home() / ".cache" / "kvstore" / "bench"
KVSTORE = ("http", "tcp", "shm", "shm-lease", "shm-lent", "shm-inplace")
GET_ONLY = ("shm-lease", "shm-lent", "shm-inplace")  # their puts are shm's
CELLS = [("get", 1), ("put", 1), ("get", 8), ("put", 8)]


def make_blob(tokens: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 4, tokens, 8, 64, generator=g).half())


def start_server(capacity: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [
        sys.executable,
        "-m",
        "kvstore.server",
        "--tiers",
        "cpu",
        "--cpu-capacity",
        capacity,
        "--port",
        "0",
    ]
    proc = subprocess.Popen(cmd + ["--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"kvstore-server did not start: {line!r}")
    return proc, line.split()[-1]


class System:
    """One contender: calls over a pool of stored keys, `blobs[i]` the one put under `keys[i]`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cursor = 0

    def prepare(self, keys: list[str], blobs: list[bytes]) -> None:
        self.keys, self.blobs = keys, blobs

    def next_keys(self, n: int) -> list[str]:
        return [self.keys[i] for i in self.next_indices(n)]

    def next_indices(self, n: int) -> list[int]:
        out = [(self.cursor + i) % len(self.keys) for i in range(n)]
        self.cursor += n
        return out

    def op(self, op: str, batch: int) -> Callable[[], int]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class KVStoreSystem(System):
    def __init__(self, name: str, url: str) -> None:
        super().__init__(name)
        transport = name.split("-")[0]
        self.be = RemoteBackend(url, transport=transport, timeout=60, read_index=name != "shm-lent")
        assert self.be.transport == transport, (name, self.be.transport)

    def prepare(self, keys: list[str], blobs: list[bytes]) -> None:
        super().prepare(keys, blobs)
        if self.name == "http":  # one store behind all transports: load it once
            for i in range(0, len(keys), 8):
                self.be.batch_put(list(zip(keys[i : i + 8], blobs[i : i + 8], strict=True)))

    def op(self, op: str, batch: int) -> Callable[[], int]:
        be, blobs = self.be, self.blobs
        if op == "put":

            def put() -> int:  # noqa: E306
                items = [(self.keys[j], blobs[j]) for j in self.next_indices(batch)]
                be.put_blob(*items[0]) if batch == 1 else be.batch_put(items)
                return sum(len(b) for _, b in items)

            return put
        if self.name in GET_ONLY:

            def lease() -> int:  # noqa: E306
                ks = self.next_keys(batch)
                with be.lease(ks, in_place=self.name == "shm-inplace") as got:
                    for k, blob, header in zip(ks, got.blobs, got.headers, strict=True):
                        header or verify_blob(blob, key=k)  # as the connectors do: once, by the SDK or here
                    assert all(got.intact())
                    return sum(len(b) for b in got)

            return lease
        if batch == 1:
            return lambda: len(be.get_blob(self.next_keys(1)[0]))
        return lambda: sum(len(b) for b in be.batch_get(self.next_keys(batch)))

    def close(self) -> None:
        self.be.close()


class ValkeySystem(System):
    def __init__(self, url: str) -> None:
        super().__init__("valkey")
        import redis  # noqa: PLC0415

        self.r = redis.Redis.from_url(url)

    def prepare(self, keys: list[str], blobs: list[bytes]) -> None:
        super().prepare(keys, blobs)
        self.r.flushall()
        for i in range(0, len(keys), 8):
            self.r.mset(dict(zip(keys[i : i + 8], blobs[i : i + 8], strict=True)))

    def op(self, op: str, batch: int) -> Callable[[], int]:
        r, blobs = self.r, self.blobs
        if op == "put":

            def put() -> int:  # noqa: E306
                items = {self.keys[j]: blobs[j] for j in self.next_indices(batch)}
                r.set(*next(iter(items.items()))) if batch == 1 else r.mset(items)
                return sum(len(b) for b in items.values())

            return put
        if batch == 1:
            return lambda: len(r.get(self.next_keys(1)[0]))
        return lambda: sum(len(b) for b in r.mget(self.next_keys(batch)))


class MemcpySystem(System):
    """A get copies a stored buffer into a caller's buffer; a put copies a source into a stored one."""

    def __init__(self) -> None:
        super().__init__("memcpy")

    def prepare(self, keys: list[str], blobs: list[bytes]) -> None:
        super().prepare(keys, blobs)
        self.stored = [np.frombuffer(b, np.uint8).copy() for b in blobs]
        self.sources = [np.frombuffer(b, np.uint8) for b in blobs]
        self.dest = [np.ones(len(blobs[0]), np.uint8) for _ in range(8)]

    def op(self, op: str, batch: int) -> Callable[[], int]:
        def copy() -> int:
            n = 0
            for i in range(batch):
                j = self.cursor % len(self.stored)
                if op == "get":
                    np.copyto(self.dest[i], self.stored[j])
                else:
                    np.copyto(self.stored[j], self.sources[self.cursor % len(self.sources)])
                self.cursor += 1
                n += len(self.dest[i])
            return n

        return copy


def timed(fn: Callable[[], int], budget: int) -> float:
    """MB/s of calls of `fn` until about `budget` bytes moved (4 calls at least)."""
    moved, calls = 0, 0
    start = time.perf_counter()
    while moved < budget or calls < 4:
        moved += fn()
        calls += 1
    return moved / (time.perf_counter() - start) / 1e6


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):5.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="comma-separated, of " + ",".join(SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-mib", type=int, default=32, help="bytes each system moves per cell and round")
    ap.add_argument("--pool-mib", type=int, default=256, help="bytes of distinct stored keys per size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server, url = start_server(f"{2 * args.pool_mib + 256}MiB")
    valkey = ValkeyProcess().start()
    systems: list[System] = [
        *(KVStoreSystem(n, url) for n in KVSTORE),
        ValkeySystem(valkey.url),
        MemcpySystem(),
    ]
    rows = []
    try:
        for size_name in args.sizes.split(","):
            tokens = SIZES[size_name]
            blob0 = make_blob(tokens, 0)
            variants = max(16, (64 << 20) // len(blob0))
            unbound = [blob0] + [make_blob(tokens, s) for s in range(1, variants)]
            header = verify_blob(blob0)
            keys = [f"{tokens:04x}{i:028x}" for i in range(max(64, (args.pool_mib << 20) // len(blob0)))]
            # each blob bound to its key, as the connectors put them: the server keeps it as sent
            blobs = [bytes(bind_blob(unbound[i % len(unbound)], header, k)) for i, k in enumerate(keys)]
            del unbound
            for s in systems:
                s.prepare(keys, blobs)
            for s in systems:  # warm-up: every system reads the whole pool once, untimed
                get = s.op("get", 8)
                for _ in range(0, len(keys), 8):
                    get()
            for op, batch in CELLS:
                cast = [s for s in systems if op == "get" or s.name not in GET_ONLY]
                runs: dict[str, list[float]] = {s.name: [] for s in cast}
                for r in range(args.rounds):
                    for s in cast[r % len(cast) :] + cast[: r % len(cast)]:
                        runs[s.name].append(timed(s.op(op, batch), args.budget_mib << 20))
                row = {"size": size_name, "op": op, "batch": batch, "MBps": runs}
                rows.append(row)
                print_row(row, header=len(rows) == 1)
    finally:
        for s in systems:
            s.close()
        server.terminate()
        server.wait(30)
        valkey.close()
    summarize(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_server.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {OUT / 'bench_server.json'}")


def ratios(row: dict, a: str, b: str) -> list[float]:
    return [x / y for x, y in zip(row["MBps"][a], row["MBps"][b], strict=True)]


def print_row(row: dict, header: bool) -> None:
    names = [*KVSTORE, "valkey", "memcpy"]
    if header:
        print(f"{'size':>6} {'op':>3} {'n':>1} | " + " ".join(f"{n:>9}" for n in names)
              + " | " + " ".join(f"{n + '/valkey':>21}" for n in KVSTORE))  # fmt: skip
        print("  (MB/s: median of rounds; ratios: median [min-max] of per-round ratios)")
    got = row["MBps"]
    mbps = " ".join(f"{statistics.median(got[n]):9.0f}" if n in got else f"{'-':>9}" for n in names)
    vs = " ".join(f"{spread(ratios(row, n, 'valkey')):>21}" if n in got else f"{'-':>21}" for n in KVSTORE)
    print(f"{row['size']:>6} {row['op']:>3} {row['batch']:>1} | {mbps} | {vs}", flush=True)


def summarize(rows: list[dict]) -> None:
    cell = {(r["size"], r["op"], r["batch"]): r for r in rows}
    print("\nwhat the design asks for (median [min-max] of per-round ratios):")
    for (size, op, batch), r in cell.items():
        if batch == 1:
            best = (
                "tcp" if op == "get" else max(("tcp", "shm"), key=lambda n: statistics.median(r["MBps"][n]))
            )
            print(f"  {size:>6} single {op} {best} / valkey: {spread(ratios(r, best, 'valkey'))}")
        if (size, op, 1) in cell and batch == 8:
            for n in ("tcp", "shm"):
                single = cell[(size, op, 1)]["MBps"][n]
                per_round = [b / s for b, s in zip(r["MBps"][n], single, strict=True)]
                print(f"  {size:>6} batch {op} x8 {n} / single {op} {n}: {spread(per_round)}")
            if op == "get":
                for n in GET_ONLY:
                    print(f"  {size:>6} batch get x8 {n} / valkey MGET: {spread(ratios(r, n, 'valkey'))}")
    for (size, op, batch), r in cell.items():
        if op == "get":  # what the arena index buys a lease: no request (in place) vs the lend round trip
            print(
                f"  {size:>6} lease x{batch} shm-inplace / shm-lent: {spread(ratios(r, 'shm-inplace', 'shm-lent'))}"
            )
    for (size, op, batch), r in cell.items():
        if op == "get" and batch == 1:
            for n in GET_ONLY:
                print(f"  {size:>6} {n} get (verified): {statistics.median(r['MBps'][n]) / 1e3:.2f} GB/s, "
                      f"{spread(ratios(r, n, 'memcpy'))} of memcpy")  # fmt: skip


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
