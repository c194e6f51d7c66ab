"""`python -m kvstore.demo` (`make demo`): the store doing its job, end to end, in a few seconds.

Part 1, the store: a prompt is cut into chunk keys (Spec 1), KV chunks go into a cpu + disk store,
`lookup_prefix` finds the reusable prefix of a second prompt, every chunk comes back bit-exact, and a
restarted store still has them (the disk tier's warm restart). The KV tensors here are synthetic, in
SmolLM2-135M's layout; the engine part of the demo computes real ones.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from kvstore.blob import decode_blob, encode_blob
from kvstore.config import StoreConfig
from kvstore.keys import KVLayout, chunk_keys, config_hash
from kvstore.store import TieredStore

# SmolLM2-135M: 30 layers, 3 KV heads of 64; a 256-token fp16 chunk is 5.9 MB
LAYOUT = KVLayout("SmolLM2-135M-Instruct", config_hash({"demo": 1}), 30, 3, 64, "float16", 256)
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
        store.batch_put([(k, encode_blob(kv)) for k, kv in zip(keys, chunks, strict=True)])
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
            assert torch.equal(decode_blob(store.get_blob(k)), kv), "round trip changed the KV"
        print(f"all {len(keys)} chunks read back bit-exact")

    with TieredStore(config) as store:  # a restart: the disk tier rebuilds its index from the files
        n = store.lookup_prefix(keys)
        assert n == len(keys)
        for k, kv in zip(keys, chunks, strict=True):
            assert torch.equal(decode_blob(store.get_blob(k)), kv)
        s = store.stats()
        print(f"after a restart: lookup_prefix = {n}/{len(keys)}; reads served by " +
              ", ".join(f"{t['name']} {t['hits']}" for t in s["tiers"]) +
              f"; hit rate {s['hit_rate']:.0%}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description="kvstore demo")
    ap.add_argument("--data-dir", type=Path, default=None, help="disk tier directory (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print("== kvstore: the store ==")
    if args.data_dir is not None:
        store_round_trip(args.data_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
            store_round_trip(Path(tmp))


if __name__ == "__main__":
    main()
