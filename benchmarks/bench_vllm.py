"""vLLM TTFT with kvstore (KVStoreConnectorV1) on SmolLM2, bf16, vLLM's CPU build, one core per server.

    .venv/bin/python benchmarks/bench_vllm.py [--rounds 3] [--lengths 1024 4096] [--codecs raw fp8 int4]
    .venv/bin/python benchmarks/bench_vllm.py --tp 2 [--rounds 3] [--lengths 4096]

Per round, prompt length and codec, on a prompt nobody has seen (random tokens):
  cold           vLLM A (kv_both) computes the whole prompt; its connector stores the chunks (raw)
  vLLM prefix    A answers the same prompt again from its own in-memory prefix cache
  kvstore cpu    vLLM B (kv_consumer, a process that never saw the prompt) loads every full chunk from a
                 kvstore-server's cpu tier
  kvstore disk   vLLM C (kv_consumer, likewise) loads them from a disk-only kvstore-server, the files
                 dropped from the page cache first (fsync + POSIX_FADV_DONTNEED on just those files)
Between cold and the loads the bench re-encodes the stored chunks with the codec under test (raw, fp8,
int4) and puts them into both servers; the readers decode any codec. TTFT is the wall time of one
max_tokens=1 completion over HTTP. Systems are interleaved within every round; the table shows median
TTFTs, and the median (min-max) over rounds of the per-round ratios. Goal: a 4k kvstore hit >= 10x
faster than cold and within 2x of vLLM's own prefix-cache hit.

`--tp 2`: tensor parallel (both cores, one a rank) on a random-weight Llama of SmolLM2's size whose heads
split over two ranks (8 heads, 4 KV heads of 64; SmolLM2's 9 / 3 do not): vLLM A (kv_both, TP=2) computes
the prompt cold and stores it (its saves gather the heads to rank 0), A answers it again from its own
prefix cache, and vLLM B (kv_consumer, TP=2, a process that never saw it) loads it from the store, each
rank its own heads. Raw codec, a cpu-tier kvstore-server.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.connectors.config import KVTransferConfig  # noqa: E402
from kvstore.sdk import Store  # noqa: E402

from kvstore.blob import decode_blob, encode_blob  # noqa: E402
from kvstore.keys import KVLayout, chunk_keys  # noqa: E402
from tests.connectors.conftest import ServerProcess  # noqa: E402
from tests.connectors.vllm.conftest import free_port  # noqa: E402
from tests.connectors.vllm.vllm_util import VllmServer, complete, start_all, transfer_config  # noqa: E402

SYSTEMS = ("cold", "vLLM prefix", "kvstore cpu", "kvstore disk")


def layout_of(model_dir: Path) -> KVLayout:
    import json  # noqa: PLC0415

    raw = json.loads((model_dir / "config.json").read_text())
    return KVLayout.for_model(
        raw, model=str(model_dir), kv_dtype="bfloat16", chunk_size=KVTransferConfig().chunk_size
    )


def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = complete(url, prompt, max_tokens=1)
    return time.perf_counter() - t0, out["cached"] or 0


def wait_stored(client: Store, keys: list[str], timeout: float = 120) -> None:
    """A's saves run in the background (kv_both): wait until every chunk is in the store."""
    deadline = time.monotonic() + timeout
    while client.lookup_prefix(keys) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM A did not store the prompt's chunks")
        time.sleep(0.05)


def recode(src: Store, dsts: list[Store], keys: list[str], codec: str) -> int:
    """Re-encode the raw chunks of `keys` with `codec` into every store in `dsts`; returns the bytes."""
    total = 0
    for key, blob in zip(keys, src.batch_get_blobs(keys), strict=True):
        assert blob is not None, key
        data = encode_blob(decode_blob(blob), codec=codec) if codec != "raw" else bytes(blob)
        total += len(data)
        for d in dsts:
            d.put(key, data)
    return total


def drop_page_cache(disk: Path, keys: list[str]) -> None:
    for key in keys:
        for path in disk.rglob(f"{key}*"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--codecs", nargs="+", default=["raw", "fp8", "int4"])
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (2: the TP run above)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.tp > 1:
        return main_tp(args)
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    model_dir = ensure_smollm2()
    layout = layout_of(model_dir)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        tmp = Path(tmp)
        cpu = ServerProcess("--tiers", "cpu", "--cpu-capacity", "4GiB").start()
        disk = ServerProcess(
            "--tiers", "disk", "--disk-capacity", "8GiB", "--disk-path", str(tmp / "disk")
        ).start()
        servers: list[VllmServer] = []
        try:
            for i, (role, url) in enumerate(
                [("kv_both", cpu.url), ("kv_consumer", cpu.url), ("kv_consumer", disk.url)]
            ):
                servers.append(
                    VllmServer(
                        model_dir, free_port(), transfer_config(url, role), tmp / f"vllm{i}.log", core=i
                    )
                )
            start_all(servers)
            a, b, c = (s.url for s in servers)
            with Store.connect(cpu.url) as cpu_client, Store.connect(disk.url) as disk_client:
                # First-request warm-up of each server, not measured: a short prompt, then one as long as
                # the longest measured (vLLM's first long-context step grows its buffers: ~0.1 s that A's
                # prefix hit never pays, its cold run came first). Each server computes its own.
                # (string seeds: the measured prompts are Random(1), Random(2), ...; Random(-n) is Random(n))
                for i, url in enumerate((a, b, c)):
                    ttft(url, [random.Random("warm").randrange(49152) for _ in range(300)])
                    ttft(url, [random.Random(f"warm-{i}").randrange(49152) for _ in range(max(args.lengths))])
                return run(args, layout, (a, b, c), cpu_client, disk_client, tmp / "disk")
        finally:
            for s in servers:
                s.stop()
            cpu.stop()
            disk.stop()


def tp_model(out: Path) -> Path:
    """A random-weight Llama of SmolLM2's size whose 8 heads / 4 KV heads split over TP ranks, with
    SmolLM2's tokenizer (the same vocabulary)."""
    import shutil  # noqa: PLC0415

    import transformers  # noqa: PLC0415
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_smollm2() / name, out / name)
    return out


def main_tp(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-tp-") as tmp:
        tmp = Path(tmp)
        model_dir = tp_model(tmp / "llama-tp")
        layout = layout_of(model_dir)
        store = ServerProcess("--tiers", "cpu", "--cpu-capacity", "4GiB").start()
        flags = ("--tensor-parallel-size", str(args.tp))
        servers = [
            VllmServer(model_dir, free_port(), transfer_config(store.url, role), tmp / f"vllm-{role}.log",
                       core="|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)), extra_args=flags)
            for role in ("kv_both", "kv_consumer")
        ]  # fmt: skip
        try:
            start_all(servers)
            a, b = (s.url for s in servers)
            for i, url in enumerate((a, b)):  # warm-up, not measured
                ttft(url, [random.Random(f"warm-{i}").randrange(49152) for _ in range(max(args.lengths))])
            with Store.connect(store.url) as client:
                return run_tp(args, layout, a, b, client)
        finally:
            for s in servers:
                s.stop()
            store.stop()


def run_tp(args, layout: KVLayout, a: str, b: str, client: Store) -> int:
    names = ("cold", "vLLM prefix", "kvstore hit")
    times: dict[tuple[int, str], list[float]] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    print(f"TP={args.tp}, rounds {args.rounds}, lengths {args.lengths}; each row: TTFT s", flush=True)
    for r in range(args.rounds):
        for n in args.lengths:
            prompt = [random.Random(f"tp-{r}-{n}").randrange(49152) for _ in range(n)]
            got = {"cold": ttft(a, prompt)[0]}
            wait_stored(client, chunk_keys(prompt, layout))
            got["vLLM prefix"] = ttft(a, prompt)[0]
            got["kvstore hit"], hit = ttft(b, prompt)
            for k, t in got.items():
                times.setdefault((n, k), []).append(t)
            ratios.setdefault((n, "cold/hit"), []).append(got["cold"] / got["kvstore hit"])
            ratios.setdefault((n, "hit/prefix"), []).append(got["kvstore hit"] / got["vLLM prefix"])
            print(f"round {r} {n:5d} tok: " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()) + f"  (hit {hit})",
                  flush=True)  # fmt: skip
    print(
        f"\n{'prompt':>6} | "
        + " | ".join(f"{k:>12}" for k in names)
        + " | cold / hit           | hit / prefix"
    )
    for n in args.lengths:
        med = [statistics.median(times[n, k]) for k in names]
        print(f"{n:>6} | " + " | ".join(f"{t:11.3f}s" for t in med)
              + f" | {spread(ratios[n, 'cold/hit']):<20} | {spread(ratios[n, 'hit/prefix'])}")  # fmt: skip
    return 0


def run(args, layout: KVLayout, urls, cpu_client: Store, disk_client: Store, disk_dir: Path) -> int:
    a, b, c = urls
    times: dict[tuple[int, str, str], list[float]] = {}
    ratios: dict[tuple[int, str, str], list[float]] = {}
    sizes: dict[tuple[int, str], int] = {}
    hits: dict[tuple[int, str], int] = {}
    print(f"rounds {args.rounds}, lengths {args.lengths}, codecs {args.codecs}; each row: TTFT s", flush=True)
    seed = 0
    for r in range(args.rounds):
        for n in args.lengths:
            for codec in args.codecs:
                seed += 1
                prompt = [random.Random(seed).randrange(49152) for _ in range(n)]
                keys = chunk_keys(prompt, layout)
                got = {"cold": ttft(a, prompt)[0]}
                wait_stored(cpu_client, keys)
                got["vLLM prefix"] = ttft(a, prompt)[0]
                sizes[n, codec] = recode(cpu_client, [cpu_client, disk_client], keys, codec)
                got["kvstore cpu"], hits[n, codec] = ttft(b, prompt)
                drop_page_cache(disk_dir, keys)
                got["kvstore disk"], _ = ttft(c, prompt)
                for name, t in got.items():
                    times.setdefault((n, codec, name), []).append(t)
                for name in ("kvstore cpu", "kvstore disk"):
                    ratios.setdefault((n, codec, "cold/" + name), []).append(got["cold"] / got[name])
                    ratios.setdefault((n, codec, name + "/prefix"), []).append(got[name] / got["vLLM prefix"])
                print(
                    f"round {r} {n:5d} tok {codec:4s}: " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()),
                    flush=True,
                )
    print(f"\n{'prompt':>6} {'codec':5} | {'MiB':>5} {'hit tok':>7} | " + " | ".join(f"{s:>12}" for s in SYSTEMS)
          + " | cold / kvstore cpu   | kvstore cpu / prefix | cold / kvstore disk  | kvstore disk / prefix")  # fmt: skip
    for n in args.lengths:
        for codec in args.codecs:
            med = [statistics.median(times[n, codec, s]) for s in SYSTEMS]
            cols = [spread(ratios[n, codec, k]) for k in ("cold/kvstore cpu", "kvstore cpu/prefix",
                                                           "cold/kvstore disk", "kvstore disk/prefix")]  # fmt: skip
            print(f"{n:>6} {codec:5} | {sizes[n, codec] / 2**20:5.1f} {hits[n, codec]:>7} | "
                  + " | ".join(f"{t:11.3f}s" for t in med) + " | " + " | ".join(f"{x:<20}" for x in cols))  # fmt: skip
    print("ratios: median over rounds of the per-round ratio (min-max); MiB: the stored chunks of one prompt")
    return 0


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
