"""Consistency scenarios for load_server.py (issue 30): restarts, outages and dropped write-backs never
serve a deleted or an older blob, and never lose an acknowledged write the ack promised to keep.

Each scenario runs real kvstore-server processes (and a real valkey-server where Redis is involved)
and reads every key back; a read must return the latest acknowledged version of its key, a version
sent later whose answer was cut off by a shutdown, or a miss where the acknowledgement allowed one
(a write-back's 201 names only the cpu tier). Counted:

- wrong or older bytes served: anything else (a deleted blob, an older version, another key's bytes);
- acknowledged writes lost: a miss of a blob whose acknowledgement (or a completed flush) put it in a
  tier that keeps it (disk, a durable Valkey) when nothing may have evicted it.

    restart   a DELETE and a replacing PUT while Valkey is down, past redis_max_invalidated too, then
              the server SIGKILLed and restarted before Valkey returns (AOF brings the old blobs back)
    back      --write-policy back with a 2-blob queue: replaces drop their write-back, then the newer
              blobs are evicted from cpu
    sigterm   --write-policy back, SIGTERM amid 4 writers replacing keys; restarted on the disk alone
              (sigterm-drop: the same with a 2-blob queue, so most write-backs were dropped)
    admission --admission-hits 1: v1 admitted to disk, v2 put and evicted before its admission
    misplaced another key's valid blob written over a key's disk file and its Valkey value
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Versions = Callable[[str, int], bytes]  # (key, version) -> that version's blob


@functools.lru_cache(maxsize=512)  # (~64 MiB)
def versioned_blob(k: str, v: int) -> bytes:
    """Version `v` of key `k`: a 128 KiB blob bound to `k`, different for every (key, version)."""
    import torch  # noqa: PLC0415

    from kvstore.blob import encode_blob  # noqa: PLC0415

    g = torch.Generator().manual_seed(int(k[-12:], 16) * 1_000_003 + v)
    return encode_blob(torch.randn(2, 2, 32, 8, 64, generator=g).half(), key=k)


@dataclass
class Tally:
    name: str
    reads: int = 0
    wrong: int = 0  # wrong or older bytes served
    lost: int = 0  # acknowledged writes lost
    notes: dict[str, int] = field(default_factory=dict)

    def read(self, got: object, allowed: set[bytes], keep: bool) -> None:
        """One read: `allowed` are the versions it may return; `keep`: a miss is a lost write."""
        self.reads += 1
        if got is None:
            self.lost += keep
        elif bytes(got) not in allowed:  # type: ignore[arg-type]
            self.wrong += 1


def launch(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A kvstore-server subprocess on a free port; (process, url)."""
    env = dict(env or os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kvstore.server", "--port", "0", "--log-level", "ERROR", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def client(url: str):  # noqa: ANN201 (sdk.remote.RemoteBackend)
    from kvstore.sdk.remote import RemoteBackend  # noqa: PLC0415

    return RemoteBackend(url, transport="http", retries=0, timeout=30)


@contextlib.contextmanager
def served(args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, Any]]:
    """A server (`launch`) and a client of it; both stopped at the end (SIGTERM, then SIGKILL)."""
    proc, url = launch(args, env)
    be = client(url)
    try:
        yield proc, be
    finally:
        be.close()
        stop(proc)


def key(i: int) -> str:
    return f"c0de{i:028x}"


def scenario_restart(blob: Versions, work: Path) -> Tally:
    from kvstore.errors import Unavailable  # noqa: PLC0415
    from tests.valkey import ValkeyProcess, wait_until  # noqa: PLC0415

    t = Tally("restart during a Valkey outage")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["KVSTORE_STATE_DIR"] = str(work / "state")
    n = 24  # keys 0-7 deleted, 8-15 replaced, 16-23 untouched (the limit, 16, is hit at key 16)
    acked: dict[int, int | None] = dict.fromkeys(range(n), 0)  # latest acknowledged version (None: deleted)
    with ValkeyProcess(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as valkey:
        args = ["--tiers", "cpu,redis", "--redis-url", valkey.url, "--redis-prefix", "cs:",
                "--redis-max-invalidated", "16"]  # fmt: skip
        with served(args, env) as (proc, be):
            for i in range(n):
                be.put_blob(key(i), blob(key(i), 0))
            valkey.kill()
            for i in range(8):
                be.delete(key(i))
                acked[i] = None
            for i in range(8, 16):
                be.put_blob(key(i), blob(key(i), 1))  # 201 in cpu
                acked[i] = 1
            refused = answered = 0
            for i in range(16, 20):  # past the limit: refused, and still refused when retried
                for _ in range(2):
                    try:
                        be.delete(key(i))
                        answered += 1
                        acked[i] = None
                    except Unavailable:
                        refused += 1
                try:
                    be.put_blob(key(i), blob(key(i), 1))
                    acked[i] = 1  # (a 201 here would have to hold up too)
                except Unavailable:
                    refused += 1
            t.notes["503 refused past the limit"] = refused
            t.notes["refused deletes answered later"] = answered
            stop(proc, signal.SIGKILL)
        with served(args, env) as (_, be):  # Valkey still down: an empty cpu tier, the journal replayed
            valkey.start()  # its AOF brings the deleted and the older blobs back
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # from Valkey's return until the replay, and once after
                for i in range(n):
                    v = acked[i]
                    t.read(be.get_blob(key(i)), set() if v is None else {blob(key(i), v)}, keep=False)
                with valkey.client() as c:
                    if not any(c.exists(f"cs:{key(i)}") for i in range(16)):
                        break
            wait_until(lambda: be.get_blob(key(n - 1)) is not None)  # out of backoff
            for i in range(16, n):  # kept in Valkey, acknowledged before the outage: still served
                v = acked[i]
                t.read(be.get_blob(key(i)), set() if v is None else {blob(key(i), v)}, keep=v == 0)
            be.put_blob(key(8), blob(key(8), 2))  # and a replaced key works normally again
            t.read(be.get_blob(key(8)), {blob(key(8), 2)}, keep=True)
    return t


def _seed(disk: Path, blob: Versions, n: int) -> None:
    """v0 of keys 0..n-1 on the disk tier (a write-through server, stopped)."""
    with served(["--tiers", "cpu,disk", "--disk-path", str(disk)]) as (_, be):
        be.batch_put([(key(i), blob(key(i), 0)) for i in range(n)])


def _writers(url: str, blob: Versions, n: int, writers: int, rounds: int, stop_at: threading.Event):
    """`writers` threads replacing their share of the keys, round after round; (threads, acked, tried)."""
    acked = [0] * n
    tried = [0] * n

    def write(w: int) -> None:
        be = client(url)
        mine = list(range(w, n, writers))
        try:
            for v in range(1, rounds + 1):
                if stop_at.is_set():
                    return
                for i in mine:
                    tried[i] = v
                be.batch_put([(key(i), blob(key(i), v)) for i in mine])
                for i in mine:
                    acked[i] = v
        except Exception:  # the server went away (SIGTERM): what was acknowledged is recorded
            return
        finally:
            be.close()

    threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(writers)]
    for th in threads:
        th.start()
    return threads, acked, tried


def scenario_back(blob: Versions, work: Path) -> Tally:
    t = Tally("--write-policy back, queue 2")
    disk, n = work / "back", 48
    _seed(disk, blob, n)
    args = ["--tiers", "cpu,disk", "--disk-path", str(disk), "--write-policy", "back",
            "--write-back-queue", "2", "--cpu-capacity", "16MiB"]  # fmt: skip
    with served(args) as (_, be):
        threads, acked, _ = _writers(be.url, blob, n, 4, 6, threading.Event())
        for th in threads:
            th.join(120)
        for i in range(n):  # still in cpu (48 x 128 KiB < 16 MiB): the acknowledged version
            t.read(be.get_blob(key(i)), {blob(key(i), acked[i])}, keep=True)
        for j in range(200):  # evict them: 25 MiB of other keys
            be.put_blob(key(1000 + j), blob(key(1000 + j), 0))
        deadline = time.monotonic() + 30
        while be.stats()["write_back_queued"] and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(n):  # from disk now: the acknowledged version or (write-back dropped) a miss
            t.read(be.get_blob(key(i)), {blob(key(i), acked[i])}, keep=False)
        t.notes["write-backs dropped (queue full)"] = int(be.stats()["tiers"][1]["dropped_writes"])
    return t


def scenario_sigterm(blob: Versions, work: Path, queue: int = 4096) -> Tally:
    """With a queue that never fills, every acknowledged write must be on disk after the drain; with a
    2-blob queue most write-backs drop: a miss then, never an older version."""
    t = Tally(f"SIGTERM mid-stream, --write-policy back, queue {queue}")
    disk, n = work / f"sigterm-{queue}", 32
    _seed(disk, blob, n)
    args = ["--tiers", "cpu,disk", "--disk-path", str(disk), "--write-policy", "back",
            "--write-back-queue", str(queue), "--shutdown-timeout", "10"]  # fmt: skip
    stop_at = threading.Event()
    with served(args) as (proc, be):
        threads, acked, tried = _writers(be.url, blob, n, 4, 10_000, stop_at)
        deadline = time.monotonic() + 60
        while min(acked) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped = int(be.stats()["tiers"][1]["dropped_writes"])
        t0 = time.monotonic()
        t.notes["exit code"] = stop(proc)
        t.notes["shutdown ms"] = round((time.monotonic() - t0) * 1000)
        stop_at.set()
        for th in threads:
            th.join(30)
    t.notes["write-backs dropped before SIGTERM"] = dropped
    with served(["--tiers", "disk", "--disk-path", str(disk)]) as (_, be):  # no cpu copy to hide behind
        got = be.batch_get([key(i) for i in range(n)])
        for i, b in enumerate(got):  # the drain flushed every acknowledged write (none dropped)
            t.read(b, {blob(key(i), v) for v in range(acked[i], tried[i] + 1)}, keep=dropped == 0)
    return t


def scenario_admission(blob: Versions, work: Path) -> Tally:
    t = Tally("--admission-hits 1")
    n = 16
    args = ["--tiers", "cpu,disk", "--disk-path", str(work / "admission"), "--admission-hits", "1",
            "--cpu-capacity", "4MiB"]  # fmt: skip
    with served(args) as (_, be):
        for i in range(n):
            be.put_blob(key(i), blob(key(i), 1))
            be.get_blob(key(i))  # admitted: v1 on disk
        for i in range(n // 2):  # half are replaced; v2 not read yet: not admitted
            be.put_blob(key(i), blob(key(i), 2))
        for j in range(64):  # evict everything from cpu (8 MiB)
            be.put_blob(key(1000 + j), blob(key(1000 + j), 0))
        for i in range(n):  # replaced: v2 or a miss, never v1; the others: v1 from disk (admitted)
            replaced = i < n // 2
            t.read(be.get_blob(key(i)), {blob(key(i), 2 if replaced else 1)}, keep=not replaced)
    return t


def scenario_misplaced(blob: Versions, work: Path) -> Tally:
    from tests.valkey import ValkeyProcess  # noqa: PLC0415

    t = Tally("another key's blob in a key's place (disk file, Valkey value)")
    disk, n = work / "misplaced", 8
    _seed(disk, blob, n)
    for i in range(0, n, 2):  # key i's file replaced by key i+1's valid blob
        shard = disk / key(i)[:2] / key(i)[2:4]
        shutil.copyfile(shard / key(i + 1), shard / key(i))
    with served(["--tiers", "disk", "--disk-path", str(disk)]) as (_, be):
        for i in range(n):
            t.read(be.get_blob(key(i)), {blob(key(i), 0)}, keep=False)
    with ValkeyProcess() as valkey:
        with valkey.client() as c:
            for i in range(0, n, 2):
                c.set(f"mp:{key(i)}", blob(key(i + 1), 0))
        args = ["--tiers", "cpu,redis", "--redis-url", valkey.url, "--redis-prefix", "mp:"]
        with served(args) as (_, be):
            for i in range(0, n, 2):
                t.read(be.get_blob(key(i)), set(), keep=False)
    return t


SCENARIOS = {
    "restart": scenario_restart,
    "back": scenario_back,
    "sigterm": scenario_sigterm,
    "sigterm-drop": functools.partial(scenario_sigterm, queue=2),
    "admission": scenario_admission,
    "misplaced": scenario_misplaced,
}


def run_scenarios(names: list[str] | None = None, blob: Versions = versioned_blob) -> list[Tally]:
    with tempfile.TemporaryDirectory(prefix="kvstore-consistency-") as d:
        return [SCENARIOS[name](blob, Path(d)) for name in names or list(SCENARIOS)]


def main() -> None:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    names = ap.parse_args().scenarios
    if set(names) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(set(names) - set(SCENARIOS))}; choose from {list(SCENARIOS)}")
    ok = report(run_scenarios(names))
    sys.exit(0 if ok else 1)


def report(tallies: list[Tally]) -> bool:
    """Print the counts; True when every scenario served 0 wrong/older bytes and lost 0 writes."""
    print("consistency scenarios (issue 30: restarts, outages, dropped write-backs):")
    for t in tallies:
        notes = ", ".join(f"{k} {v}" for k, v in t.notes.items())
        print(f"  {t.name}: {t.reads} reads; wrong or older bytes served: {t.wrong}, "
              f"acknowledged writes lost: {t.lost}" + (f" ({notes})" if notes else ""))  # fmt: skip
    wrong, lost = sum(t.wrong for t in tallies), sum(t.lost for t in tallies)
    print(f"  all scenarios: wrong or older bytes served: {wrong}, acknowledged writes lost: {lost}")
    return wrong == 0 and lost == 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
