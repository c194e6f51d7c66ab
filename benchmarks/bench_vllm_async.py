"""Running requests while another one loads a long prefix: sync vs async loads, vLLM CPU, SmolLM2.

    .venv/bin/python benchmarks/bench_vllm_async.py [--rounds 3] [--prefix 8000] [--streams 4]

Two vLLM servers on one kvstore-server (cpu tier), the same but for the connector's `load_async`
(false: the load runs inside the engine step, before the forward; true: a background thread loads while
the other requests keep stepping). Per round and server, interleaved: `--streams` requests decode
(short prompts, 200 tokens each, streamed); once they are all decoding, a request whose `--prefix`-token
prompt is in the store (stored by the other server earlier) arrives and loads it. Measured on the
streams, in the window from that request's arrival to its first token: decode tokens/s of the running
requests and their longest gap between two tokens; and the loading request's TTFT. Rounds alternate
which server goes first. The table: medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.connectors.conftest import ServerProcess  # noqa: E402
from tests.connectors.vllm.conftest import free_port  # noqa: E402
from tests.connectors.vllm.vllm_util import VllmServer, complete, start_all, transfer_config  # noqa: E402

VOCAB = 49152


def stream(
    url: str, prompt: list[int], max_tokens: int, stamps: list[float], started: threading.Event
) -> None:
    """One streamed greedy completion; the arrival time of every token goes into `stamps`."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                started.set()


def one_round(url: str, prefix: list[int], streams: int, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    started = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(
            target=stream, args=(url, [rnd.randrange(VOCAB) for _ in range(64)], 200, stamps[i], started[i])
        )  # fmt: skip
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    for e in started:
        e.wait(120)
    time.sleep(1.0)  # all of them decoding
    t0 = time.perf_counter()
    out = complete(url, prefix, max_tokens=1)
    t1 = time.perf_counter()
    for t in threads:
        t.join()
    window = [s for st in stamps for s in st if t0 <= s <= t1]
    gaps = [b - a for st in stamps for a, b in zip(st, st[1:], strict=False) if b >= t0 and a <= t1]
    return {"ttft": t1 - t0, "tok_s": len(window) / (t1 - t0), "max_gap": max(gaps, default=0.0),
            "cached": float(out["cached"] or 0)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefix", type=int, default=8000)
    p.add_argument("--streams", type=int, default=4)
    args = p.parse_args()
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    model_dir = ensure_smollm2()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-async-") as tmp:
        store = ServerProcess("--tiers", "cpu", "--cpu-capacity", "8GiB").start()
        servers = [
            VllmServer(
                model_dir,
                free_port(),
                transfer_config(store.url, "kv_both", load_async=mode),
                Path(tmp) / f"vllm-{mode}.log",
                core=i,
            )  # fmt: skip
            for i, mode in enumerate((False, True))
        ]
        try:
            start_all(servers)
            names = {False: "sync", True: "async"}
            results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
            for s in servers:  # warm-up: a long prompt each
                complete(
                    s.url, [random.Random("warm").randrange(VOCAB) for _ in range(args.prefix)], max_tokens=1
                )
            for r in range(args.rounds):
                order = [0, 1] if r % 2 == 0 else [1, 0]
                for i in order:
                    mode = (False, True)[i]
                    prefix = [random.Random(f"{r}-{i}").randrange(VOCAB) for _ in range(args.prefix)]
                    complete(servers[1 - i].url, prefix, max_tokens=1)  # the other server stores it
                    time.sleep(1.0)  # its saves land
                    got = one_round(servers[i].url, prefix, args.streams, seed=r * 10 + i)
                    results[names[mode]].append(got)
                    print(f"round {r} {names[mode]:5}: " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()),
                          flush=True)  # fmt: skip
            print(f"\n{args.streams} decoding requests while one loads a {args.prefix}-token prefix "
                  f"(median of {args.rounds} rounds)")  # fmt: skip
            print(
                f"{'loads':6} | {'decode tok/s':>12} | {'longest gap s':>13} | {'loader TTFT s':>13} | loaded tok"
            )
            for name, rows in results.items():
                med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
                print(f"{name:6} | {med['tok_s']:12.1f} | {med['max_gap']:13.3f} | {med['ttft']:13.3f} | "
                      f"{med['cached']:.0f}")  # fmt: skip
        finally:
            for s in servers:
                s.stop()
            store.stop()
    return 0


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
