"""SGLang HiCache's storage tier (L3): kvstore's backend against SGLang's own `file` backend, each driven
by SGLang's real HiCacheController (its backup and prefetch threads) over the very same host pool, on CPU.

    .venv/sglang/bin/python benchmarks/bench_sglang.py [--rounds 7] [--pages 32] [--page-tokens 32]
    (.venv/bin/python re-runs it in the SGLang venv of `make sglang-env`)

Backends, one controller each on one shared device pool and host pool (page_first, not pinned):
`file` (SGLang's HiCacheFile in a temporary directory: its generic page path, one file per page, written
into and read back from the page cache: no fsync, no disk read), `kvstore v1` (a kvstore-server on this
host, cpu tier, started here; the zero-copy batch_set_v1/batch_get_v1 path over shared memory) and
`kvstore generic` (the same server through SGLang's flat-page path). Each round backs up new pages
through every backend, then prefetches them back, the backends' order rotating per round; a backup is
timed from `write_storage` to its acknowledgement, a prefetch from handing the hit to the I/O thread to
its completion, the hit query separately. Reported: each backend's median pages/s and GB/s, and the
median (min-max) over rounds of each round's kvstore/file ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.connectors.sglang.sglang_env import SGL_PYTHON, env  # noqa: E402

WAIT_S = 120.0


def start_server(capacity: str) -> tuple[subprocess.Popen, str]:
    python = ROOT / ".venv" / "bin" / "python"
    cmd = [str(python if python.exists() else sys.executable), "-m", "kvstore.server", "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--tiers", "cpu", "--cpu-capacity", capacity]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("kvstore-server did not start")


def backup(engine, tokens: list[int], seed: int) -> float:
    """Seconds to back up len(tokens)/page new pages of random KV (filling them is not timed)."""
    n = len(tokens) // engine.page
    idx, _ = engine.fill(n, seed)
    hashes = engine.hashes(tokens)
    try:
        t0 = time.perf_counter()
        engine.ctrl.write_storage(idx, tokens, hash_value=hashes)
        op = engine.ctrl.ack_backup_queue.get(timeout=WAIT_S)
        seconds = time.perf_counter() - t0
    finally:
        engine.host.free(idx)
    assert op.completed_tokens == len(tokens), f"backup stored {op.completed_tokens} of {len(tokens)} tokens"
    return seconds


def prefetch(engine, tokens: list[int], rid: str) -> tuple[float, float]:
    """(hit query seconds, prefetch seconds) of pages stored before."""
    t0 = time.perf_counter()
    op = engine.ctrl.prefetch(rid, tokens)
    assert engine.ctrl.prefetch_hit_queue.get(timeout=WAIT_S) is op
    query = time.perf_counter() - t0
    assert op.storage_hit_count == len(tokens), f"hit {op.storage_hit_count} of {len(tokens)} tokens"
    idx = engine.host.alloc(len(tokens))
    try:
        op.host_indices = idx
        t1 = time.perf_counter()
        engine.ctrl.prefetch_buffer.put(op)
        done, deadline = 0, time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                ack = engine.ctrl.ack_prefetch_queue.get(timeout=1)
            except Empty:
                continue
            done = max(done, ack.completed_tokens or 0)
            if ack.completed_req:
                break
        seconds = time.perf_counter() - t1
    finally:
        engine.host.free(idx)
    assert done == len(tokens), f"prefetched {done} of {len(tokens)} tokens"
    return query, seconds


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--pages", type=int, default=32, help="pages backed up and prefetched per round and backend"
    )
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads of this rank")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()

    from tests.connectors.sglang.harness import BACKEND, Engine, init_process, tokens  # noqa: PLC0415

    page_bytes = 2 * args.layers * args.page_tokens * args.heads * args.head_dim * 2
    round_bytes = args.pages * page_bytes
    capacity = f"{max(1, 3 * args.rounds * round_bytes // 2**30 + 1)}GiB"
    print(
        f"pages of {args.page_tokens} tokens x {args.layers} layers x {args.heads} KV heads x {args.head_dim} "
        f"bf16 = {page_bytes / 2**20:.1f} MiB; {args.pages} pages ({round_bytes / 2**20:.0f} MiB) per round and "
        f"backend, {args.rounds} rounds; host pool page_first, not pinned; {os.cpu_count()} CPUs"
    )
    init_process(29000 + os.getpid() % 1000)
    proc, url = start_server(capacity)
    tmp = tempfile.TemporaryDirectory(prefix="hicache-file-")
    engines = {}
    try:
        geo = dict(page=args.page_tokens, layers=args.layers, heads=args.heads, head_dim=args.head_dim)
        host_tokens = 2 * args.pages * args.page_tokens
        base = Engine(
            {**BACKEND, "url": url, "interface_v1": 1}, **geo, device_tokens=4 * args.page_tokens,
            host_ratio=host_tokens / (4 * args.page_tokens) + 1, model="bench-model",
        )  # fmt: skip
        engines["kvstore v1"] = base
        engines["kvstore generic"] = Engine(
            {**BACKEND, "url": url, "interface_v1": 0}, **geo, pools=base, model="bench-model-generic"
        )
        engines["file"] = Engine({"file_storage_path": tmp.name}, backend="file", **geo, pools=base)
        names = list(engines)
        rows: dict[str, dict[str, list[float]]] = {
            n: {"backup": [], "prefetch": [], "query": []} for n in names
        }
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            prompts = {n: tokens(args.pages * args.page_tokens, 1000 * r + i) for i, n in enumerate(names)}
            for n in order:
                rows[n]["backup"].append(backup(engines[n], prompts[n], seed=r))
            for n in order:
                q, s = prefetch(engines[n], prompts[n], f"r{r}-{n}")
                rows[n]["query"].append(q)
                rows[n]["prefetch"].append(s)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {args.pages / rows[n]['backup'][-1]:.0f}/{args.pages / rows[n]['prefetch'][-1]:.0f} pages/s"
                for n in names
            ), flush=True)  # fmt: skip
    finally:
        for e in engines.values():
            e.close()
        proc.terminate()
        proc.wait(15)
        tmp.cleanup()

    results: dict = {"page_bytes": page_bytes, "pages": args.pages, "rounds": args.rounds, "backends": {}}
    print(
        f"\n{'backend':<16} {'backup pages/s':>15} {'GB/s':>6} {'prefetch pages/s':>17} {'GB/s':>6} {'hit query ms':>13}"
    )
    for n in names:
        b = statistics.median(args.pages / s for s in rows[n]["backup"])
        p = statistics.median(args.pages / s for s in rows[n]["prefetch"])
        q = statistics.median(rows[n]["query"]) * 1e3
        results["backends"][n] = {"backup_pages_s": b, "prefetch_pages_s": p, "hit_query_ms": q}
        print(
            f"{n:<16} {b:>15.0f} {b * page_bytes / 1e9:>6.2f} {p:>17.0f} {p * page_bytes / 1e9:>6.2f} {q:>13.2f}"
        )
    print("\nkvstore / file, per round: median (min-max)")
    for n in names[:-1]:
        up = [f / k for k, f in zip(rows[n]["backup"], rows["file"]["backup"], strict=True)]
        down = [f / k for k, f in zip(rows[n]["prefetch"], rows["file"]["prefetch"], strict=True)]
        results["backends"][n]["backup_ratio"] = statistics.median(up)
        results["backends"][n]["prefetch_ratio"] = statistics.median(down)
        print(f"{n:<16} backup {spread(up)}   prefetch {spread(down)}")
    return results


if __name__ == "__main__":
    if importlib.util.find_spec("sglang") is None and SGL_PYTHON.exists():  # run in the SGLang venv
        os.execve(str(SGL_PYTHON), [str(SGL_PYTHON), __file__, *sys.argv[1:]], env())
    for name, value in env().items():
        os.environ.setdefault(name, value)  # SGLang's caches under the venv, this checkout importable
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
