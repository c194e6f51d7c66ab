"""The connector's data path at SmolLM2's KV geometry (30 layers, 3 KV heads, head_dim 64, block 16):
save (copy-out + encode + put) and load (fetch + verify/decode + scatter into the paged cache) of a
4,096-token prompt, per store and codec, next to a plain memcpy of the same bytes in the same run.

    .venv/bin/python benchmarks/bench_connector.py [--tokens 4096] [--dtype float32] [--server]

`--server` adds a kvstore-server (cpu tier) started by this script on a free port.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.connectors.base import KVConnectorMetadata, KVConnectorRole  # noqa: E402
from kvstore.connectors.config import KVTransferConfig  # noqa: E402
from kvstore.connectors.kvstore import KVStoreConnector  # noqa: E402
from kvstore.connectors.meta import LoadSpec, SaveSpec, StepTransfers  # noqa: E402

from kvstore.codecs import codec_names  # noqa: E402

LAYERS, HEADS, DIM, BS, CS = 30, 3, 64, 16, 256


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--port", "0", "--tiers", "cpu", "--cpu-capacity", "2GiB"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("kvstore-server did not start")


def run(name: str, config: KVTransferConfig, tokens: int, dtype: torch.dtype, memcpy_gbs: float) -> None:
    num_blocks = 2 * tokens // BS + 8
    caches = [torch.randn(2, num_blocks, BS, HEADS, DIM).to(dtype) for _ in range(LAYERS)]
    worker = KVStoreConnector(KVConnectorRole.WORKER, config)
    try:
        worker.register_kv_caches(caches)
        n_chunks = tokens // CS
        src = list(range(tokens // BS))
        dst = list(range(tokens // BS, 2 * tokens // BS))
        keys = [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).hexdigest() for i in range(n_chunks)]
        saves = [SaveSpec("r", keys[c], c, tuple(src[c * 16 : (c + 1) * 16])) for c in range(n_chunks)]
        t0 = time.perf_counter()
        worker.bind_connector_metadata(KVConnectorMetadata({"kvstore_transfers": StepTransfers(saves=saves)}))
        worker.wait_for_save()
        t_copy = time.perf_counter() - t0
        worker.flush()
        t_save = time.perf_counter() - t0
        load = LoadSpec("r", tuple(keys), 0, tuple(dst), 0, tokens)
        worker.bind_connector_metadata(
            KVConnectorMetadata({"kvstore_transfers": StepTransfers(loads=[load])})
        )
        t0 = time.perf_counter()
        worker.start_load_kv()
        t_load = time.perf_counter() - t0
        assert not worker.get_block_ids_with_load_errors()
        exact = all(torch.equal(c[:, dst], c[:, src]) for c in caches)
        nbytes = sum(c[:, src].numel() * c.element_size() for c in caches)
        stored = worker.metrics.snapshot()["kvstore_connector_save_bytes_total"]
        print(
            f"{name:<22} {nbytes / 2**20:7.1f} MiB -> {stored / 2**20:6.1f} MiB stored | "
            f"copy-out {t_copy * 1e3:7.1f} ms | save {t_save * 1e3:7.1f} ms ({nbytes / t_save / 1e9:5.2f} GB/s) | "
            f"load {t_load * 1e3:7.1f} ms ({nbytes / t_load / 1e9:5.2f} GB/s, {nbytes / t_load / 1e9 / memcpy_gbs:5.1%} "
            f"of memcpy) | {'bit-exact' if exact else 'lossy'}"
        )
    finally:
        worker.shutdown()


def memcpy_gbs(nbytes: int) -> float:
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(0)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--server", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    nbytes = 2 * LAYERS * args.tokens * HEADS * DIM * dtype.itemsize
    mc = memcpy_gbs(nbytes)
    print(
        f"{args.tokens} tokens of {args.dtype} KV = {nbytes / 2**20:.1f} MiB; memcpy {mc:.2f} GB/s (1 thread)"
    )
    base = {"local_cpu_capacity": "2GiB", "chunk_size": CS}
    layout = {
        "model_name": "bench", "model_config_hash": "0" * 32, "num_layers": LAYERS, "num_kv_heads": HEADS,
        "head_dim": DIM, "kv_dtype": args.dtype, "block_size": BS,
    }  # fmt: skip
    codecs = [c for c in ("raw", "fp8", "int4") if c in codec_names()]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(f"local cpu {c}", KVTransferConfig(codec=c, **base)) for c in codecs]
        rows.append(
            (
                "local disk raw",
                KVTransferConfig(local_tiers=["disk"], local_disk_path=Path(tmp) / "d", **base),
            )
        )
        proc = None
        if args.server:
            proc, url = start_server()
            rows.append(("server cpu raw", KVTransferConfig(store_url=url, **base)))
        try:
            for name, cfg in rows:
                run(name, cfg.for_engine(**layout), args.tokens, dtype, mc)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(15)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
