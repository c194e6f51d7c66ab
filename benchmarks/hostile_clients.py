"""Hostile clients for benchmarks/load_server.py, all in one process beside the honest ones:

- slow headers: connections that send a header byte now and then and never finish (slow loris);
- idle sockets: connections that connect and never send anything;
- oversized concurrent puts: threads putting blobs far larger than the honest ones, at once;
- a hung Redis: SIGSTOP the server's valkey for a while, SIGCONT, again;
- forged TOUCH reports (issue 30 #10): a data-plane client claiming thousands of arena-index gets of
  keys never stored, 3,599 s each: the server must count none of them (no miss, no measured latency),
  and what it counts as reported is at most the time since that client's HELLO;
- odd transfer codings (issue 30 #12): puts with `Transfer-Encoding: identity, chunked`: each a 501.

Each counts what the server did to it; oversized puts the server acknowledged are logged like the
honest clients' puts, because they evict honest blobs (the lost-write check counts their bytes).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from kvstore.protocol import dataplane as dp
from kvstore.protocol import wire

PUT = 0  # the event kinds of load_server.py


@dataclass
class HostileConfig:
    slow_headers: int = 200
    idle_sockets: int = 200
    oversized_threads: int = 6
    oversized_bytes: int = 128 * 2**20
    redis_pid: int | None = None
    redis_hang_s: float = 8.0
    redis_run_s: float = 12.0
    forged_touches: int = 2  # TOUCH messages per second, each of 4,000 absent keys
    odd_codings: int = 5  # puts per second with Transfer-Encoding: identity, chunked


@dataclass
class HostileReport:
    slow_closed_408: int = 0
    slow_closed_other: int = 0
    idle_closed: int = 0
    refused_503: int = 0  # connections refused over max_connections
    oversized: dict[str, int] = field(default_factory=dict)  # status -> count
    redis_hangs: int = 0
    touches_sent: int = 0
    reported_gets: float = 0.0  # what the server counted as reported gets, over every client
    reported_seconds_mean: float = 0.0  # their mean claimed seconds, as the server bounded them
    odd_codings: dict[str, int] = field(default_factory=dict)  # status -> count
    log: list[tuple[float, str, int, int]] = field(default_factory=list)


def _connect(port: int) -> socket.socket | None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None
    s.setblocking(False)
    return s


def _loris_and_idle(port: int, cfg: HostileConfig, rep: HostileReport, stop: threading.Event) -> None:
    """One selector loop drives every slow and idle connection; a closed one is opened again."""
    sel = selectors.DefaultSelector()
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000

    def open_one(kind: str) -> None:
        s = _connect(port)
        if s is not None:
            sel.register(s, selectors.EVENT_READ, [kind, 0, b""])

    for _ in range(cfg.slow_headers):
        open_one("slow")
    for _ in range(cfg.idle_sockets):
        open_one("idle")
    next_drip = time.monotonic()
    while not stop.is_set():
        for sk, _ in sel.select(timeout=0.2):
            state = sk.data
            try:
                chunk = sk.fileobj.recv(65536)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if chunk:
                state[2] += chunk
                continue
            answer = state[2]
            if answer.startswith(b"HTTP/1.1 503"):
                rep.refused_503 += 1
            elif state[0] == "slow":
                if answer.startswith(b"HTTP/1.1 408"):
                    rep.slow_closed_408 += 1
                else:
                    rep.slow_closed_other += 1
            else:
                rep.idle_closed += 1
            sel.unregister(sk.fileobj)
            sk.fileobj.close()  # type: ignore[union-attr]
            open_one(state[0])
        if time.monotonic() >= next_drip:  # every slow connection sends one more header byte
            next_drip += 1.0
            for sk in list(sel.get_map().values()):
                state = sk.data
                if state[0] == "slow" and state[1] < len(head):
                    try:
                        sk.fileobj.send(head[state[1] : state[1] + 1])  # type: ignore[union-attr]
                        state[1] += 1
                    except OSError:
                        pass
    for sk in list(sel.get_map().values()):
        sk.fileobj.close()  # type: ignore[union-attr]


def _oversized(port: int, blob: bytes, tid: int, rep: HostileReport, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        key = f"ffff{tid:04x}{n:024x}"
        n += 1
        head = (
            f"PUT {wire.chunk_path(key)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {wire.BLOB_CONTENT_TYPE}\r\n"
            f"Content-Length: {len(blob)}\r\nConnection: close\r\n\r\n"
        ).encode()
        status = "error"
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(head)
                try:
                    s.sendall(blob)
                except OSError:
                    pass  # refused early (503): the server answered and stopped reading
                answer = b""
                while b"\r\n" not in answer:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
                status = answer.split(b" ", 2)[1].decode() if answer.count(b" ") >= 2 else "closed"
        except OSError as e:
            status = type(e).__name__
        rep.oversized[status] = rep.oversized.get(status, 0) + 1
        if status == "201":
            rep.log.append((time.monotonic(), key, len(blob), PUT, started))  # stored in between
        else:
            stop.wait(0.2)


def _forge_touches(port: int, cfg: HostileConfig, rep: HostileReport, stop: threading.Event) -> None:
    absent = [f"dddd{i:028x}" for i in range(4000)]  # never put by anyone
    meta = dp.pack_meta({"k": absent, "g": [[len(absent), 3599.0]]})
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(dp.PREFACE + dp.pack_head(dp.HELLO, dp.pack_meta({"v": dp.VERSION})))
                s.recv(65536)  # its answer (the index, when the server has one)
                while not stop.wait(1 / cfg.forged_touches):
                    s.sendall(dp.pack_head(dp.TOUCH, meta))
                    rep.touches_sent += 1
        except OSError:
            stop.wait(0.5)  # closed by the server (it never should be for a well-formed TOUCH): again
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return
    count = sum(
        float(v) for v in re.findall(r'^kvstore_reported_get_seconds_count\{op="\w+"\} (\S+)$', text, re.M)
    )
    total = sum(
        float(v) for v in re.findall(r'^kvstore_reported_get_seconds_sum\{op="\w+"\} (\S+)$', text, re.M)
    )
    rep.reported_gets, rep.reported_seconds_mean = count, total / count if count else 0.0


def _odd_codings(port: int, cfg: HostileConfig, rep: HostileReport, stop: threading.Event) -> None:
    head = (
        f"PUT {wire.chunk_path('eeee' + '0' * 28)} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {wire.BLOB_CONTENT_TYPE}\r\nTransfer-Encoding: identity, chunked\r\nConnection: close\r\n\r\n"
        "4\r\nabcd\r\n0\r\n\r\n"
    ).encode()
    while not stop.wait(1 / cfg.odd_codings):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(head)
                status = s.recv(4096).split(b" ", 2)[1].decode()
        except (OSError, IndexError) as e:
            status = type(e).__name__
        rep.odd_codings[status] = rep.odd_codings.get(status, 0) + 1


def _hang_redis(cfg: HostileConfig, rep: HostileReport, stop: threading.Event) -> None:
    assert cfg.redis_pid is not None
    while not stop.wait(cfg.redis_run_s):
        os.kill(cfg.redis_pid, signal.SIGSTOP)
        rep.redis_hangs += 1
        stop.wait(cfg.redis_hang_s)
        os.kill(cfg.redis_pid, signal.SIGCONT)
    os.kill(cfg.redis_pid, signal.SIGCONT)


def run_hostile(port: int, duration: float, cfg: HostileConfig, oversized_blob: bytes) -> HostileReport:
    """Every hostile client for `duration` seconds; returns what happened to them."""
    rep = HostileReport()
    stop = threading.Event()
    threads = [threading.Thread(target=_loris_and_idle, args=(port, cfg, rep, stop), daemon=True)]
    threads += [
        threading.Thread(target=_oversized, args=(port, oversized_blob, t, rep, stop), daemon=True)
        for t in range(cfg.oversized_threads)
    ]
    threads.append(threading.Thread(target=_forge_touches, args=(port, cfg, rep, stop), daemon=True))
    threads.append(threading.Thread(target=_odd_codings, args=(port, cfg, rep, stop), daemon=True))
    if cfg.redis_pid is not None:
        threads.append(threading.Thread(target=_hang_redis, args=(cfg, rep, stop), daemon=True))
    for t in threads:
        t.start()
    stop.wait(duration)
    stop.set()
    for t in threads:
        t.join(90)
    return rep
