"""Codec throughput and size next to memcpy, measured side by side in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_codecs.py                 # CPU, numba kernels, 1 thread
    PYTHONPATH=. .venv/bin/python benchmarks/bench_codecs.py --threads 2     # K and V on 2 threads
    PYTHONPATH=. .venv/bin/python benchmarks/bench_codecs.py --model DIR     # lz4 ratios on real SmolLM2 KV
    PYTHONPATH=. python benchmarks/bench_codecs.py --cuda                    # Triton kernels on a GPU

On a SmolLM2-shaped chunk `[2, 30, 256, 3, 64]` float16 (5.9 MB): encode and decode GB/s of every
codec configuration (GB of fp16 KV per second), at the codec level (the kernels, into a payload)
and at the blob level (`encode_blob`/`decode_blob`: + checksum, + lz4), the size ratio vs fp16, and
memcpy GB/s (`np.copyto` of the same 5.9 MB into a prefaulted buffer) measured right before each row.
--cuda: Triton encode/decode GB/s on device tensors vs a device-to-device copy of the same tensor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvstore.blob import decode_blob, encode_blob
from kvstore.codecs import get_codec
from kvstore.codecs.lz4 import compress

GB = 1e9
CONFIGS: list[tuple[str, str, dict]] = [
    ("raw", "raw", {}),
    ("fp8 (token scales)", "fp8", {}),
    ("fp8 (tensor scale)", "fp8", {"fp8_scale": "tensor"}),
    ("int4 default (K chan g64, V g64, sink 1)", "int4", {}),
    ("int4 sink 0", "int4", {"sink_tokens": 0}),
    ("int4 g32", "int4", {"group_size": 32}),
    ("int4 K chan g128", "int4", {"key_group_size": 128}),
    ("int4 K token, Hadamard", "int4", {"keys": "token", "rotate": True}),
    ("kivi4 default", "kivi4", {}),
    ("kivi2 default", "kivi2", {}),
    ("kivi4+ans", "kivi4+ans", {}),
    ("kivi2+ans", "kivi2+ans", {}),
    ("fp8+ans", "fp8+ans", {}),
]


def timed(fn: Callable[[], object], reps: int) -> float:
    """Best seconds of `reps` calls after one warm-up: on a shared, noisy box the minimum is the
    figure that other processes disturb least (memcpy is measured the same way)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def synthetic_kv(tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 30, tokens, 3, 64, generator=g)
    kv[0, ..., 5] *= 10  # keys have outlier channels
    return kv.half()


def model_kv(model_dir: Path, tokens: int) -> torch.Tensor:
    """The real KV of the first `tokens` tokens of the quality text through the model."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_codec_quality import TEXT, load, prefill_kv  # noqa: PLC0415

    model, tokenizer = load(model_dir)
    ids = torch.tensor([tokenizer.encode(TEXT).ids[:tokens]])
    return prefill_kv(model, ids).half()


def bench_cpu(kv: torch.Tensor, reps: int) -> None:
    nbytes = kv.numel() * kv.element_size()
    src, dst = kv.view(torch.uint8).numpy().reshape(-1), np.empty(nbytes, np.uint8)
    print(
        f"chunk {list(kv.shape)} {kv.dtype}, {nbytes / 1e6:.1f} MB; 1 thread; GB/s of fp16 KV; best of {reps}"
    )
    head = f"{'codec':42s} {'ratio':>6s} {'enc':>6s} {'dec':>6s} {'blob enc':>8s} {'blob dec':>8s} {'memcpy':>7s}"
    print(head + f" {'enc/memcpy':>10s} {'dec/memcpy':>10s}")
    for name, codec, opts in CONFIGS:
        for lz4 in (False, True):
            if lz4 and codec == "int4" and opts:
                continue  # lz4 on one int4 config says it all
            c = get_codec(codec)
            memcpy = nbytes / timed(lambda: np.copyto(dst, src), reps) / GB
            payload, params = c.encode(kv, **opts)
            enc = nbytes / timed(lambda c=c, o=opts: c.encode(kv, **o), reps) / GB
            dec = (
                nbytes
                / timed(lambda c=c, p=payload, q=params: c.decode(p, q, tuple(kv.shape), kv.dtype), reps)
                / GB
            )
            blob = encode_blob(kv, codec=codec, lz4=lz4, **opts)
            benc = (
                nbytes / timed(lambda c=codec, z=lz4, o=opts: encode_blob(kv, codec=c, lz4=z, **o), reps) / GB
            )
            bdec = nbytes / timed(lambda b=blob: decode_blob(b), reps) / GB
            label = name + (" + lz4" if lz4 else "")
            print(f"{label:42s} {nbytes / len(blob):6.2f} {enc:6.2f} {dec:6.2f} {benc:8.2f} {bdec:8.2f} "
                  f"{memcpy:7.2f} {enc / memcpy:10.2f} {dec / memcpy:10.2f}")  # fmt: skip
    print("\nlz4 alone on each payload (ratio = payload / lz4 output), with and without a byte shuffle:")
    for name, codec, opts in CONFIGS[:4]:
        payload = bytes(get_codec(codec).encode(kv, **opts)[0])
        width = 2 if codec == "raw" else 4 if codec == "fp8" else 2
        arr = np.frombuffer(payload[: len(payload) - len(payload) % width], np.uint8)
        shuffled = arr.reshape(-1, width).T.copy().tobytes()
        print(f"  {name:42s} lz4 {len(payload) / len(compress(payload)):5.3f}x   "
              f"shuffle{width}+lz4 {len(shuffled) / len(compress(shuffled)):5.3f}x")  # fmt: skip


def bench_cuda(kv: torch.Tensor, reps: int) -> None:
    from kvstore.codecs import triton_kernels as tk  # noqa: PLC0415
    from kvstore.codecs.int4 import layout_for  # noqa: PLC0415

    x = kv.cuda()
    nbytes = x.numel() * x.element_size()
    y = torch.empty_like(x)

    def gpu_time(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / 10)
        return statistics.median(times)

    print(
        f"{torch.cuda.get_device_name()}: chunk {list(x.shape)} {x.dtype}, {nbytes / 1e6:.1f} MB, median of {reps}x10"
    )
    print(
        f"{'codec':42s} {'enc GB/s':>9s} {'dec GB/s':>9s} {'d2d copy':>9s} {'enc/copy':>9s} {'dec/copy':>9s}"
    )
    for name, codec, opts in CONFIGS[1:]:
        copy = nbytes / gpu_time(lambda: y.copy_(x)) / GB
        if codec == "fp8":
            mode = opts.get("fp8_scale", "token")
            codes, scales = tk.fp8_encode(x, mode)
            enc = nbytes / gpu_time(lambda m=mode: tk.fp8_encode(x, m)) / GB
            dec = (
                nbytes
                / gpu_time(lambda m=mode, c=codes, s=scales: tk.fp8_decode(c, s, m, tuple(x.shape), x.dtype))
                / GB
            )
        else:
            lay = layout_for(tuple(x.shape), x.dtype, **opts)
            buf = tk.int4_encode(x, lay)
            enc = nbytes / gpu_time(lambda lay=lay: tk.int4_encode(x, lay)) / GB
            dec = nbytes / gpu_time(lambda lay=lay, b=buf: tk.int4_decode(b, lay, x.dtype)) / GB
        print(f"{name:42s} {enc:9.1f} {dec:9.1f} {copy:9.1f} {enc / copy:9.2f} {dec / copy:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk (default 256)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model", type=Path, help="HF Llama dir: take the chunk's KV from a real prefill")
    ap.add_argument("--cuda", action="store_true", help="Triton kernels on the GPU vs device copy")
    ap.add_argument(
        "--threads", type=int, default=1, help="KVSTORE_CODEC_THREADS for the CPU kernels (1 or 2)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["KVSTORE_CODEC_THREADS"] = str(args.threads)
    kv = model_kv(args.model, args.tokens) if args.model else synthetic_kv(args.tokens)
    if args.cuda:
        bench_cuda(kv, args.reps)
    else:
        bench_cpu(kv, args.reps)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
