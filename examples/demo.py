"""`python examples/demo.py` (`make demo`): the store doing its job, end to end.

Part 1, the store: a prompt is cut into chunk keys (Spec 1), KV chunks go into a cpu + disk store,
`lookup_prefix` finds the reusable prefix of a second prompt, every chunk comes back bit-exact, and a
restarted store still has them (the disk tier's warm restart). The KV tensors here are synthetic, in
SmolLM2-135M's layout; the engine part of the demo computes real ones.

Part 2, the engine: SmolLM2 is prepared, `kvstore-server` (cpu,disk) starts, and `kvstore-engine serve
--kv-backend kvstore` answers questions about one long shared document twice: cold, then as a NEW
engine process after a restart. The restarted engine's first request finds the document's KV in the
store instead of recomputing it: TTFT cold vs warm and the hit rates are printed. Everything the demo
starts, it stops. It is no part of the core: it uses the store in process and runs the engine and the
server as the commands a user runs, talking to them over HTTP.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvstore.blob import decode_blob, encode_blob
from kvstore.config import StoreConfig
from kvstore.keys import KVLayout, chunk_keys, config_hash
from kvstore.store import TieredStore

# SmolLM2-135M: 30 layers, 3 KV heads of 64; a 256-token fp16 chunk is 5.9 MB
LAYOUT = KVLayout("SmolLM2-135M-Instruct", config_hash({"demo": 1}), 30, 3, 64, "float16", 256)
MODELS_DIR = Path.home() / ".cache" / "kvstore" / "models"
PROMPT = "You are a helpful assistant. Answer briefly and cite the document. " * 16


def tokens_of(text: str) -> list[int]:
    """Byte-level tokens: enough for keys (the engine part uses the model's tokenizer)."""
    return list(text.encode())


def synthetic_kv(num_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (2, LAYOUT.num_layers, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(torch.float16)


def store_round_trip(data_dir: Path) -> None:
    config = StoreConfig(
        tiers=["cpu", "disk"], cpu_capacity="12MiB", disk_capacity="1GiB", disk_path=data_dir
    )
    tokens = tokens_of(PROMPT)
    keys = chunk_keys(tokens, LAYOUT)
    print(f"prompt: {len(tokens)} tokens -> {len(keys)} full chunks of {LAYOUT.chunk_size}; keys:")
    for k in keys:
        print(f"  {k}")
    chunks = [synthetic_kv(LAYOUT.chunk_size, i) for i in range(len(keys))]

    with TieredStore(config) as store:
        t0 = time.perf_counter()
        store.batch_put([(k, encode_blob(kv, key=k)) for k, kv in zip(keys, chunks, strict=True)])
        dt = time.perf_counter() - t0
        size = sum(c.numel() * c.element_size() for c in chunks)
        print(f"put {len(keys)} chunks, {size / 1e6:.1f} MB, in {dt * 1e3:.0f} ms (disk writes are fsync'ed)")
        cpu, disk = store.tiers
        print(f"cpu tier holds {len(cpu)} chunks ({cpu.usage() / 1e6:.1f} of {cpu.capacity / 1e6:.1f} MB, LRU), "
              f"disk tier {len(disk)}")  # fmt: skip

        other = tokens_of(PROMPT[:300] + "A different question follows here. " * 40)
        hit = store.lookup_prefix(chunk_keys(other, LAYOUT))
        print(f"a second prompt sharing the first {300} characters reuses {hit} chunk(s) "
              f"= {hit * LAYOUT.chunk_size} tokens")  # fmt: skip
        assert hit == 1

        for k, kv in zip(keys, chunks, strict=True):
            assert torch.equal(decode_blob(store.get_blob(k), key=k), kv), "round trip changed the KV"
        print(f"all {len(keys)} chunks read back bit-exact")

    with TieredStore(config) as store:  # a restart: the disk tier rebuilds its index from the files
        n = store.lookup_prefix(keys)
        assert n == len(keys)
        for k, kv in zip(keys, chunks, strict=True):
            assert torch.equal(decode_blob(store.get_blob(k), key=k), kv)
        s = store.stats()
        print(f"after a restart: lookup_prefix = {n}/{len(keys)}; reads served by " +
              ", ".join(f"{t['name']} {t['hits']}" for t in s["tiers"]) +
              f"; hit rate {s['hit_rate']:.0%}")  # fmt: skip


# ---- part 2: the engine reusing KV through kvstore-server -----------------------------------------
DOCUMENT = " ".join(
    f"Section {i}. The harbour authority records every arrival and departure, the tonnage of each "
    f"vessel, the berth it used and the weather at the time; entry {i} notes a {['calm', 'windy', 'foggy'][i % 3]} "
    f"morning, a pilot boarding at the outer mark and {i % 7 + 2} tugs assisting."
    for i in range(24)
)
QUESTIONS = [
    "Question: what does the harbour authority record? Answer:",
    "Question: how many tugs assisted in section 12? Answer:",
    "Question: summarise the harbour records in one sentence. Answer:",
]


class Service:
    """A subprocess this demo started (and will stop)."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                m = re.search(pattern, line)
                if m:
                    return m
            seen = len(self.lines)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, service: Service, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited:\n" + "".join(service.lines[-20:]))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{service.name} did not become healthy")


def stream_ttft(port: int, prompt: str, max_tokens: int = 16) -> tuple[float, str]:
    """POST a streaming completion; (seconds to the first token, the whole text)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"completion failed: {resp.status} {resp.read()[:500]!r}")
    first, text = None, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if first is None:
            first = time.perf_counter() - t0
        text.append(json.loads(line[6:])["choices"][0]["text"])
    return first or float("nan"), "".join(text)


def engine_metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    out: dict[str, float] = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def engine_round(store_url: str, label: str) -> list[float]:
    """Start an engine, send the shared-prefix workload, print its TTFTs and hit rates, stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvstore.engine", "serve", "--port", str(port), "--kv-backend", "kvstore",
           "--kv-store-url", store_url, "--max-model-len", "2048", "--kv-cache-memory", "256MiB"]  # fmt: skip
    engine = Service("kvstore-engine", cmd)
    try:
        t0 = time.perf_counter()
        wait_healthy(port, engine)
        print(f"\n{label}: engine up in {time.perf_counter() - t0:.1f} s (a new process, empty prefix cache)")
        ttfts = []
        for q in QUESTIONS:
            ttft, text = stream_ttft(port, DOCUMENT + "\n\n" + q)
            ttfts.append(ttft)
            print(f"  TTFT {ttft * 1e3:7.0f} ms  {q[:48]!r} -> {text.strip()[:40]!r}")
        m = engine_metrics(port)
        local_q, local_h = (
            m.get("vllm:prefix_cache_queries_total", 0),
            m.get("vllm:prefix_cache_hits_total", 0),
        )
        ext_q = m.get("vllm:external_prefix_cache_queries_total", 0)
        ext_h = m.get("vllm:external_prefix_cache_hits_total", 0)
        print(f"  prompt tokens reused: {local_h:.0f} of {local_q:.0f} from the engine's prefix cache, "
              f"{ext_h:.0f} of {ext_q:.0f} from kvstore ({ext_h / max(ext_q, 1):.0%})")  # fmt: skip
        return ttfts
    finally:
        engine.stop()


def engine_demo(data_dir: Path) -> None:
    print("\n== part 2: SmolLM2 reusing KV through kvstore-server ==")
    prep = subprocess.run([sys.executable, "-m", "kvstore.engine", "model", "smollm2", str(MODELS_DIR)],
                          capture_output=True, text=True)  # fmt: skip
    if prep.returncode != 0:
        raise RuntimeError(f"preparing SmolLM2 failed:\n{prep.stderr[-2000:]}")
    print(f"model: {prep.stdout.strip()}")
    cmd = [sys.executable, "-m", "kvstore.server", "--port", "0", "--tiers", "cpu,disk", "--disk-path",
           str(data_dir / "server-disk"), "--cpu-capacity", "1GiB"]  # fmt: skip
    server = Service("kvstore-server", cmd)
    try:
        url = server.wait_for(r"listening on (http://\S+)").group(1)
        print(f"kvstore-server (cpu,disk) at {url}")
        cold = engine_round(url, "run 1, cold store")
        warm = engine_round(url, "run 2, engine restarted, same store")
        print(f"\nfirst request TTFT: cold {cold[0] * 1e3:.0f} ms -> warm {warm[0] * 1e3:.0f} ms "
              f"({cold[0] / warm[0]:.1f}x faster: the shared document came from the store)")  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="kvstore demo")
    ap.add_argument("--data-dir", type=Path, default=None, help="disk tier directory (default: a temp dir)")
    ap.add_argument("--store-only", action="store_true", help="part 1 only (no model, a few seconds)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print("== part 1: the store ==")
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        store_round_trip(data_dir / "store")
        if not args.store_only:
            engine_demo(data_dir)


if __name__ == "__main__":
    main()
