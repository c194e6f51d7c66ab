"""The rANS stage alone, on SmolLM2's real KV: what it saves and how fast it codes, per base codec.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ans.py [--model DIR] [--reps 300]

One 256-token chunk of a novel document (bench_codec_quality.DOCUMENTS[0], bf16 KV) is encoded with
each base codec; its code sections go through `kvstore.codecs.ans` (one table per layer and K/V
half, as the `+ans` codecs do). Printed per codec: the codes' size after the stage, the whole blob's
size change, and on one core the C kernel's encode / decode speed in codes per second and in GB/s of
bf16 KV those codes stand for — for the first 4 segments (one group of the AVX-512 path; best of
`--reps` runs of the same segments: a branch predictor may learn them, so an upper bound) and for the
whole chunk (best of 5) — the Python fallback's decode of one segment, and the whole blob's decode (`decode_blob`: the stage and the base codec) for the base codec
alone and with `+ans`, in GB/s of bf16 KV on one core (best of 11, then the median).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_codec_quality import DOCUMENTS, default_model_dir, load, prefill_kv, texts
from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.codecs import ans, get_codec


def best(fn, reps: int) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def times(blob: bytes, reps: int = 11) -> list[float]:
    decode_blob(blob)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        decode_blob(blob)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load(args.model or default_model_dir())
    (ids,), digest = texts(tokenizer, DOCUMENTS[:1], 512)
    kv = prefill_kv(model, ids)[:, :, 256:512].to(torch.bfloat16).contiguous()
    print(f"one {list(kv.shape)} bf16 chunk (text {digest}); C kernel: {ans.kernel_available()}\n")
    print(
        "| codec | codes after rANS | blob | 4-segment decode (best of reps) | chunk encode / decode | Python decode "
        "| blob decode: base / +ans (best, median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for base in ("fp8", "int4", "kivi4", "kivi2"):
        codec = get_codec(base + "+ans")
        blob = encode_blob(kv, codec=base)
        h = verify_blob(blob)
        payload = memoryview(blob)[h.payload_offset :]
        bits, sections = codec.code_sections(h.params, h.shape, h.dtype)
        data = np.frombuffer(payload, np.uint8)
        segs = [s for off, size, nseg in sections for s in data[off : off + size].reshape(nseg, -1)]
        ns = [s.size * 8 // bits for s in segs]
        stream = ans.encode_segments(segs, ns, bits)
        one, four = ans.encode_segments(segs[:1], ns[:1], bits), ans.encode_segments(segs[:4], ns[:4], bits)
        total, codes = sum(ns), sum(s.size for s in segs)
        t4 = best(lambda o=four, n=ns[:4], b=bits: ans.decode_segments(o, n, b), args.reps)
        te = best(lambda s=segs, n=ns, b=bits: ans.encode_segments(s, n, b), 5)
        td = best(lambda s=stream, n=ns, b=bits: ans.decode_segments(s, n, b), 5)
        tp = best(lambda o=one, n=ns[:1], b=bits: ans.decode_segments(o, n, b, use_c=False), 1)
        coded_blob = encode_blob(kv, codec=base + "+ans")
        coded, nbytes = len(coded_blob), kv.numel() * kv.element_size()
        blob_gbs = [(nbytes / min(t), nbytes / np.median(t)) for t in (times(blob), times(coded_blob))]
        print(f"| {base} ({bits}-bit codes) | {len(stream) / codes:.3f} | {len(blob)} -> {coded} B "
              f"({1 - coded / len(blob):.1%} smaller) | {sum(ns[:4]) / t4 / 1e6:.0f} M codes/s = "
              f"{2 * sum(ns[:4]) / t4 / 1e9:.2f} GB/s bf16 | {total / te / 1e6:.0f} / {total / td / 1e6:.0f} M codes/s "
              f"| {ns[0] / tp / 1e6:.2f} M codes/s | "
              + " / ".join(f"{b / 1e9:.2f} ({m / 1e9:.2f})" for b, m in blob_gbs) + " GB/s |")  # fmt: skip


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
