"""Hostile load against `kvstore-engine router` (issue 45): bystanders' latency and errors in calm and
hostile phases, interleaved round by round in one run, with the router's RSS and index size.

    flock -o /tmp/kvstore-heavy.lock .venv/bin/python benchmarks/bench_router_hostile.py --rounds 4

The router runs as its own process (`kvstore-engine router`, its RSS read from /proc) over 3 stand-in
engines in another process: tests/router/fake_engine.FakeEngine, real aiohttp HTTP servers answering
as `kvstore-engine serve` does (SSE streams, /health, /v1/models, /metrics) with a set latency (first
token after --ttft-ms, then one every --itl-ms) instead of a model, each publishing KV events (vLLM's
format) for the token-id prompts it served, which the router indexes.

Bystanders (this process): --bystanders clients sending streamed completions back to back, a
~200-token prompt from 8 shared prefixes, 8 tokens each. Their latency is the request to the stream's
last byte; an error is a status other than 200, an SSE error event, a broken connection or 30 s
without an answer.

The hostile phase adds, from a process of its own and from the engines' process:
- slowloris: --slow connections sending a header byte a second and never finishing, as many that
  connect and say nothing (reconnecting when the router closes them);
- stream non-readers: --non-readers clients asking for endless streams of 64 KiB tokens and reading
  nothing;
- huge bodies: a 7.9 MB prompt (under the engines' 8 MiB limit) back to back, and a declared 60 MB
  body (its first MiB sent);
- malformed and forged KV events on engine 0's publisher: frames of the wrong shape, a 9-byte seq, a
  wrong topic, and batches of blocks with random tokens no engine holds (bounded by the index cap);
- a hung engine: engine 2 stops answering anything, /health too (as under SIGSTOP), for the phase.

It prints both phases' bystander p50/p99 and errors, the router's RSS and index (against their
bounds) and what the router did to each hostile client, and checks: hostile p99 within 2x of calm,
0 errors, RSS and index within bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIXES = 8
PREFIX_TOKENS = 192
INDEX_CAP = 20_000  # --index-max-blocks given to the router
RSS_BOUND_MIB = 1024  # what the router may hold at most: its idle RSS + body budget (256 MiB) + headroom


# ---- the engines' process ------------------------------------------------------------------------------
ACTORS = ("slowloris", "non_readers", "huge", "events", "hang")


def engines_main(
    tmp: str, ttft_s: float, itl_s: float, actors: tuple[str, ...], ready: mp.Queue, commands: mp.Queue
) -> None:
    """3 FakeEngines with publishers; commands: "hostile" / "calm" (engine 2 hangs / resumes, engine 0's
    publisher sends malformed and forged frames / stops), "stop"."""
    import logging

    from tests.router.fake_engine import FakeEngine
    from tests.router.test_events_hostile import RawPublisher

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # clients the router cut off

    async def main() -> None:
        pubs = [RawPublisher(Path(tmp), f"e{i}") for i in range(3)]
        engines = [FakeEngine(ttft_s, itl_s, 8, publisher=p) for p in pubs]
        urls = [await e.start() for e in engines]
        ready.put([(u, p.endpoint, p.replay_endpoint) for u, p in zip(urls, pubs, strict=True)])
        loop = asyncio.get_running_loop()
        forging = threading.Event()
        sent = {"malformed": 0, "forged_batches": 0, "forged_blocks": 0}
        threading.Thread(target=forge, args=(pubs[0], forging, sent), daemon=True).start()
        while True:
            cmd = await loop.run_in_executor(None, commands.get)
            if cmd == "hostile":
                if "hang" in actors:
                    engines[2].hang()
                if "events" in actors:
                    forging.set()
            elif cmd == "calm":
                engines[2].resume()
                forging.clear()
            else:
                break
        engines[2].resume()
        forging.clear()
        for e in engines:
            await e.stop()
        for p in pubs:
            p.close()
        ready.put(sent)

    asyncio.run(main())


def forge(pub, on: threading.Event, sent: dict) -> None:
    """Malformed frames and batches of forged blocks on `pub` while `on` is set (~20 frames a second)."""
    from kvstore.events import block_stored

    rng = random.Random(7)
    while True:
        on.wait()
        for frames in (
            (b"", b"x" * 9, b"\x91"),
            (b"", b"\x00"),
            (b"other-topic", (1).to_bytes(8, "big"), b"\x90"),
        ):
            pub.send_raw(*frames)
            sent["malformed"] += 1
        events, parent = [], None
        for _ in range(500):
            h = rng.getrandbits(63).to_bytes(8, "big")
            events.append(block_stored([h], parent, [rng.randrange(50_000) for _ in range(16)], 16, "GPU"))
            parent = h
        pub.publish(events)
        sent["forged_batches"] += 1
        sent["forged_blocks"] += len(events)
        time.sleep(0.05)


# ---- the hostile clients' process ----------------------------------------------------------------------
def hostile_main(
    port: int,
    slow: int,
    non_readers: int,
    huge_every_s: float,
    active: mp.Event,
    stop: mp.Event,
    out: mp.Queue,
) -> None:
    counts: dict[str, list | int] = {"slowloris_closed_s": [], "idle_closed_s": [], "slowloris_408": 0,
                                     "non_readers_closed": 0, "non_readers": 0, "huge_200": 0, "huge_other": [],
                                     "declared_60mb_413": 0, "declared_60mb_other": [], "refused_503": 0}  # fmt: skip
    threads = [threading.Thread(target=slowloris, args=(port, active, stop, counts, True), daemon=True)
               for _ in range(slow)]  # fmt: skip
    threads += [threading.Thread(target=slowloris, args=(port, active, stop, counts, False), daemon=True)
                for _ in range(slow)]  # fmt: skip
    threads += [threading.Thread(target=non_reader, args=(port, active, stop, counts), daemon=True)
                for _ in range(non_readers)]  # fmt: skip
    if huge_every_s > 0:
        threads.append(
            threading.Thread(target=huge_bodies, args=(port, huge_every_s, active, stop, counts), daemon=True)
        )
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(10)
    out.put(counts)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    return s


def slowloris(port: int, active: mp.Event, stop: mp.Event, counts: dict, send: bool) -> None:
    """A header byte a second (or nothing at all), never finishing; reconnect when closed."""
    while not stop.is_set():
        if not active.wait(0.2):
            continue
        try:
            s = _connect(port)
        except OSError:
            continue
        opened = time.monotonic()
        s.settimeout(1.0)
        got = b""
        try:
            if send:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            while active.is_set() and not stop.is_set():
                try:
                    chunk = s.recv(4096)
                    if not chunk:
                        counts["slowloris_closed_s" if send else "idle_closed_s"].append(
                            time.monotonic() - opened
                        )
                        break
                    got += chunk
                except TimeoutError:
                    if send:
                        s.sendall(b"a")
        except OSError:
            counts["slowloris_closed_s" if send else "idle_closed_s"].append(time.monotonic() - opened)
        finally:
            s.close()
        if got.startswith(b"HTTP/1.1 408"):
            counts["slowloris_408"] += 1
        elif got.startswith(b"HTTP/1.1 503"):
            counts["refused_503"] += 1


def non_reader(port: int, active: mp.Event, stop: mp.Event, counts: dict) -> None:
    """An endless stream of 64 KiB tokens, never read during the phase."""
    body = json.dumps(
        {"prompt": [1, 2, 3], "max_tokens": 10**6, "stream": True, "kvstore_fake_pad": 65536}
    ).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    while not stop.is_set():
        if not active.wait(0.2):
            continue
        try:
            s = _connect(port)
            s.sendall(head + body)
        except OSError:
            continue
        counts["non_readers"] += 1
        try:
            while active.is_set() and not stop.is_set():
                time.sleep(0.5)
            # The phase is over: read what is buffered. A router that closed the stream gave an end of
            # it (after its bytes in flight); one still writing keeps sending.
            s.settimeout(1.0)
            deadline = time.monotonic() + 5.0
            with contextlib.suppress(OSError):
                while time.monotonic() < deadline:
                    if not s.recv(2**20):
                        counts["non_readers_closed"] += 1
                        break
        finally:
            s.close()


def huge_bodies(port: int, every_s: float, active: mp.Event, stop: mp.Event, counts: dict) -> None:
    big = json.dumps({"prompt": "The keeper climbed the stairs. " * 255_000, "max_tokens": 2}).encode()
    assert len(big) < 8 * 2**20, len(big)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(big)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    head60 = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {60 * 2**20}\r\n\r\n").encode()  # fmt: skip
    while not stop.is_set():
        if not active.wait(0.2):
            continue
        started = time.monotonic()
        for data, ok, key in (
            (head + big, b"HTTP/1.1 200", "huge"),
            (head60 + b" " * 2**20, b"HTTP/1.1 413", "declared_60mb"),
        ):
            try:
                with _connect(port) as s:
                    with contextlib.suppress(OSError):
                        s.sendall(data)
                    got = s.recv(64)
            except OSError as e:
                got = repr(e).encode()
            if got.startswith(ok):
                counts[f"{key}_{'200' if key == 'huge' else '413'}"] += 1
            else:
                counts[f"{key}_other"].append(got[:40].decode(errors="replace"))
        stop.wait(max(0.0, every_s - (time.monotonic() - started)))


# ---- bystanders and sampling (this process) -------------------------------------------------------------
class Bystanders:
    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        rng = random.Random(1)
        self.prefixes = [[rng.randrange(1, 30_000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
        self.latency: dict[str, list[float]] = collections.defaultdict(list)  # per phase
        self.errors: dict[str, list[str]] = collections.defaultdict(list)
        self.served_by: dict[str, list[str]] = collections.defaultdict(list)
        self.phase = "calm"

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            await asyncio.gather(*(self._client(http, i, stop) for i in range(self.clients)))

    async def _client(self, http, i: int, stop: asyncio.Event) -> None:
        rng = random.Random(100 + i)
        while not stop.is_set():
            prompt = rng.choice(self.prefixes) + [rng.randrange(1, 30_000) for _ in range(8)]
            phase = self.phase
            started = time.perf_counter()
            try:
                async with http.post(self.url + "/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 8, "stream": True}) as r:  # fmt: skip
                    text = await r.text()
                    if r.status != 200 or "event: error" in text or not text.endswith("data: [DONE]\n\n"):
                        raise RuntimeError(f"HTTP {r.status}: {text[-200:]}")
            except Exception as e:  # noqa: BLE001 (every failure is a bystander's error)
                if phase == self.phase:
                    self.errors[phase].append(repr(e)[:200])
                continue
            if phase == self.phase:  # a request spanning a phase change counts in neither
                self.latency[phase].append(time.perf_counter() - started)
                self.served_by[phase].append(r.headers.get("X-KVStore-Engine", ""))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/router/state", timeout=10) as r:
        return json.loads(r.read())


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def start_router(
    tmp: Path, engines: list[tuple[str, str, str]], args: argparse.Namespace
) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvstore.engine", "router", "--port", "0", "--model", args.model, "--chunk-size", "16",
           "--calibrate-interval", "1", "--first-byte-timeout", "2", "--health-interval", str(args.health_interval),
           "--health-timeout", str(args.health_timeout), "--header-timeout", "2", "--keepalive-timeout", "5",
           "--timeout", "5", "--index-max-blocks", str(INDEX_CAP)]  # fmt: skip
    for url, ev, rp in engines:
        cmd += ["--engine", url, "--engine-events", ev, "--engine-replay", rp]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline and (line := proc.stdout.readline()):
        lines.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("the router did not start:\n" + "".join(lines[-30:]))


def _drain(proc: subprocess.Popen) -> None:
    """Keep reading the router's output (a full pipe would block it); its warnings go to stderr here."""
    for line in proc.stdout:
        if "WARNING" in line or "ERROR" in line or "Traceback" in line:
            sys.stderr.write("router: " + line)


async def sample(url: str, pid: int, phase: callable, stop: asyncio.Event, out: dict) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        p = phase()
        try:
            rss = rss_mib(pid)
            st = await loop.run_in_executor(None, state, url)
        except (OSError, ValueError):
            await asyncio.sleep(0.5)
            continue
        out[p]["rss"] = max(out[p].get("rss", 0.0), rss)
        out[p]["index"] = max(out[p].get("index", 0), max(st["index"]["engines"].values(), default=0))
        await asyncio.sleep(1.0)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=10.0, help="seconds of each calm and each hostile phase")
    ap.add_argument("--bystanders", type=int, default=4)
    ap.add_argument("--slow", type=int, default=150, help="slowloris connections (and as many idle ones)")
    ap.add_argument("--non-readers", type=int, default=8)
    ap.add_argument("--ttft-ms", type=float, default=30.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--health-interval", type=float, default=0.1, help="the router's --health-interval")
    ap.add_argument("--health-timeout", type=float, default=0.4, help="the router's --health-timeout")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="seconds after each phase change whose bystander requests count in neither phase")  # fmt: skip
    ap.add_argument("--model", default="smollm2", help="the router's --model (its tokenizer)")
    ap.add_argument("--huge-every-s", type=float, default=1.0, help="a 7.9 MB and a 60 MB body this often")
    ap.add_argument("--actors", default=",".join(ACTORS), help=f"the hostile actors (of {','.join(ACTORS)})")
    args = ap.parse_args()
    actors = tuple(a for a in args.actors.split(",") if a)
    assert set(actors) <= set(ACTORS), actors

    import tempfile

    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-hostile-"))
    ready, commands = ctx.Queue(), ctx.Queue()
    eng = ctx.Process(
        target=engines_main, args=(str(tmp), args.ttft_ms / 1e3, args.itl_ms / 1e3, actors, ready, commands)
    )
    eng.start()
    engines = ready.get(timeout=120)
    router, url = start_router(tmp, engines, args)
    port = int(url.rsplit(":", 1)[1])
    active, stop_hostile, hostile_out = ctx.Event(), ctx.Event(), ctx.Queue()
    hostile = ctx.Process(
        target=hostile_main,
        args=(port, args.slow if "slowloris" in actors else 0, args.non_readers if "non_readers" in actors else 0,
              args.huge_every_s if "huge" in actors else 0.0, active, stop_hostile, hostile_out),
    )  # fmt: skip
    hostile.start()
    by = Bystanders(url, args.bystanders)
    sampled: dict[str, dict] = collections.defaultdict(dict)
    idle_rss = rss_mib(router.pid)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            time.sleep(0.2)

        async def drive() -> None:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(by.run(stop)),
                     asyncio.create_task(sample(url, router.pid, lambda: by.phase, stop, sampled))]  # fmt: skip
            await asyncio.sleep(2.0)  # warm: the prefixes' blocks indexed
            by.latency.clear()
            by.errors.clear()
            by.served_by.clear()
            for r in range(args.rounds):
                for phase in ("calm", "hostile"):
                    by.phase = "settle"  # the last phase's clients winding down, or this one's starting
                    commands.put(phase)
                    (active.set if phase == "hostile" else active.clear)()
                    await asyncio.sleep(args.settle_s)
                    by.phase = phase
                    print(f"round {r + 1}/{args.rounds}: {phase}", flush=True)
                    await asyncio.sleep(args.phase_s)
            by.phase = "done"
            active.clear()
            commands.put("calm")
            stop.set()
            await asyncio.gather(*tasks)

        asyncio.run(drive())
        final = state(url)
        refused = metric_sum(url, "kvstore_router_refused_connections_total")
        header_timeouts = metric_sum(url, "kvstore_router_header_timeouts_total")
        engine_errors = metric_sum(url, "kvstore_router_engine_errors_total")
    finally:
        stop_hostile.set()
        counts = hostile_out.get(timeout=60) if hostile.is_alive() else {}
        hostile.join(30)
        commands.put("stop")
        sent = ready.get(timeout=60)
        eng.join(30)
        router.terminate()
        router.wait(30)

    rows = []
    print()
    print(f"router over 3 stand-in engines (first token {args.ttft_ms:g} ms, then {args.itl_ms:g} ms a token), "
          f"{args.bystanders} bystanders, {args.rounds} rounds x {args.phase_s:g} s calm + {args.phase_s:g} s hostile")  # fmt: skip
    print("| phase | bystander requests | p50 | p99 | errors | router RSS max | index max (cap) |")
    print("|---|---|---|---|---|---|---|")
    for phase in ("calm", "hostile"):
        lat = by.latency[phase]
        row = {"phase": phase, "requests": len(lat), "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99),
               "errors": len(by.errors[phase]), "rss_mib": sampled[phase].get("rss", 0.0),
               "index_max": sampled[phase].get("index", 0)}  # fmt: skip
        rows.append(row)
        print(f"| {phase} | {row['requests']} | {row['p50_s'] * 1e3:.1f} ms | {row['p99_s'] * 1e3:.1f} ms | "
              f"{row['errors']} | {row['rss_mib']:.0f} MiB | {row['index_max']:,} ({INDEX_CAP:,}) |")  # fmt: skip
    settle_errors = len(by.errors["settle"])
    print(f"the {args.settle_s:g} s after each phase change (counted in neither): {len(by.latency['settle'])} "
          f"requests, p99 {pct(by.latency['settle'], 0.99) * 1e3:.1f} ms, {settle_errors} errors")  # fmt: skip
    for phase in ("calm", "hostile", "settle"):
        for e in by.errors[phase][:5]:
            print(f"  {phase} error: {e}")
    calm, hostile_row = rows
    slow = [(lat, e) for lat, e in zip(by.latency["hostile"], by.served_by["hostile"], strict=True)
            if lat > 2 * calm["p99_s"]]  # fmt: skip
    names = {u: f"engine {i}" for i, (u, _, _) in enumerate(engines)}
    print(f"hostile-phase requests over 2x the calm p99: {len(slow)} "
          f"({', '.join(f'{lat * 1e3:.0f} ms on {names.get(e, e)}' for lat, e in sorted(slow)[-8:])})")  # fmt: skip
    closed = counts.get("slowloris_closed_s", [])
    idle_closed = counts.get("idle_closed_s", [])
    print(f"router idle RSS {idle_rss:.0f} MiB; index at the end {final['index']['engines']}")
    print(f"slowloris: {len(closed)} closed by the router (median {statistics.median(closed) if closed else float('nan'):.1f} s, "
          f"{counts.get('slowloris_408', 0)} with a 408); idle: {len(idle_closed)} closed (median "
          f"{statistics.median(idle_closed) if idle_closed else float('nan'):.1f} s); "
          f"{counts.get('refused_503', 0)} refused 503 (router: {refused:.0f} refused, {header_timeouts:.0f} header timeouts)")  # fmt: skip
    print(
        f"non-readers: {counts.get('non_readers', 0)} streams, {counts.get('non_readers_closed', 0)} closed by the router"
    )
    print(f"huge bodies: {counts.get('huge_200', 0)} x 7.9 MB answered 200 (others: {counts.get('huge_other', [])[:3]}); "
          f"{counts.get('declared_60mb_413', 0)} x 60 MB refused 413 (others: {counts.get('declared_60mb_other', [])[:3]})")  # fmt: skip
    print(f"KV events: {sent}; engine errors counted by the router: {engine_errors:.0f}")
    print(f"hung engine: {final['engines'][engines[2][0]]['down_why'] or 'up at the end'}")
    checks = {
        "hostile p99 within 2x of calm": hostile_row["p99_s"] <= 2 * calm["p99_s"],
        "0 bystander errors": calm["errors"] == 0 and hostile_row["errors"] == 0 and settle_errors == 0,
        f"router RSS under {RSS_BOUND_MIB} MiB": max(calm["rss_mib"], hostile_row["rss_mib"])
        <= RSS_BOUND_MIB,
        f"index within its cap ({INDEX_CAP:,} blocks an engine)": hostile_row["index_max"] <= INDEX_CAP,
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    print(f"p99 hostile / calm: {hostile_row['p99_s'] / calm['p99_s']:.2f}x")
    return {"rows": rows, "checks": checks, "hostile": counts, "events": sent, "idle_rss_mib": idle_rss}


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
