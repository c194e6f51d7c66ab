"""`--kv-cache-dtype fp8` on a real model: capacity, quality and throughput against the bf16 cache.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_cache_dtype.py            # SmolLM2, all three parts
    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_cache_dtype.py --skip-throughput

1. Capacity: blocks and tokens at the same --kv-cache-memory.
2. Quality (bench_codec_quality.py's text and method): the engine's own model (bf16 weights) prefills
   the ~1,800-token text in chunks of 256 into a paged cache of the dtype under test, every chunk
   attending to the earlier chunks as the cache holds them; every position from the second chunk on is
   scored against the same run with a bf16 cache, and against an fp32 model with an fp32 cache:
   perplexity, top-1 agreement of the next-token argmax, mean KL(reference || tested) per position.
3. Throughput: two engines (bf16 cache, fp8 cache) on the same requests, rounds interleaved, medians
   and min-max of per-round ratios; a long-context decode too, where attention reads half the bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from kvstore.engine.attention_metadata import AttentionMetadata  # noqa: E402
from kvstore.engine.kv_cache.fp8_scales import CALIBRATION_TEXT, KVScales, calibrate_kv_scales  # noqa: E402
from kvstore.engine.layers.attention import Attention  # noqa: E402
from kvstore.engine.loader import load_model  # noqa: E402
from kvstore.engine.model_runner import kv_bytes_per_block  # noqa: E402

from benchmarks.bench_codec_quality import TEXT  # noqa: E402

CHUNK = 256
BLOCK = 16


def prefill_logits(model, ids: list[int], kv_dtype: torch.dtype, scales: KVScales | None) -> torch.Tensor:
    """All-position logits [N, vocab] of `ids`, prefilled in CHUNK-token steps into a paged cache."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    h, d = layers[0].num_kv_heads, layers[0].head_dim
    n = len(ids)
    blocks = -(-n // BLOCK)
    cache = torch.zeros(len(layers), 2, blocks, BLOCK, h, d, dtype=kv_dtype)
    for i, m in enumerate(layers):
        m.kv_cache = cache[i]
        m.k_scale = None if scales is None else scales.scales[i, 0].contiguous()
        m.v_scale = None if scales is None else scales.scales[i, 1].contiguous()
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    out = []
    with torch.inference_mode():
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            meta = AttentionMetadata(
                cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32),
                context_lens=torch.tensor([hi], dtype=torch.int32),
                slot_mapping=torch.arange(lo, hi, dtype=torch.int64),
                block_tables=table, max_q_len=hi - lo, max_context_len=hi, block_size=BLOCK,
            )  # fmt: skip
            x = torch.tensor(ids[lo:hi])
            out.append(model.compute_logits(model(x, torch.arange(lo, hi), meta)))
    return torch.cat(out)


def scores(logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> tuple[float, float, float]:
    """(perplexity, top-1 agreement with ref, mean KL(ref || logits)) over positions CHUNK.. N-2."""
    sl = slice(CHUNK, len(ids) - 1)
    target = torch.tensor(ids[CHUNK + 1 :])
    logp = logits[sl].log_softmax(-1)
    ref_logp = ref[sl].log_softmax(-1)
    ppl = math.exp(-logp.gather(1, target[:, None]).mean().item())
    top1 = (logits[sl].argmax(-1) == ref[sl].argmax(-1)).float().mean().item()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    return ppl, top1, kl


def quality(model_dir: Path) -> None:
    from kvstore.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    ids = list(tok.encode(TEXT))
    torch.set_num_threads(1)
    m32, _ = load_model(model_dir, dtype="float32")
    ref32 = prefill_logits(m32, ids, torch.float32, None)
    del m32
    model, cfg = load_model(model_dir, dtype="bfloat16")
    calib = list(tok.encode(CALIBRATION_TEXT))
    ones = torch.ones(cfg.num_hidden_layers, 2, cfg.num_key_value_heads)
    configs = [
        ("bf16 cache (baseline)", torch.bfloat16, None),
        ("fp8 e4m3, calibrated scale per KV head", torch.float8_e4m3fn, calibrate_kv_scales(model, calib, "head")),
        ("fp8 e4m3, calibrated scale per layer", torch.float8_e4m3fn, calibrate_kv_scales(model, calib, "tensor")),
        ("fp8 e4m3, scale 1.0 (vLLM's default)", torch.float8_e4m3fn, KVScales(ones, "unit")),
    ]  # fmt: skip
    print(
        f"\n== quality: {cfg.model_name}, bf16 weights, {len(ids)} tokens, {len(ids) - CHUNK - 1} scored =="
    )
    print(f"{'KV cache':<42} {'ppl':>7} {'d ppl':>7} {'top-1 vs bf16':>14} {'KL vs bf16':>11} "
          f"{'top-1 vs fp32':>14} {'KL vs fp32':>11}")  # fmt: skip
    base = None
    ppl32 = scores(ref32, ref32, ids)[0]
    print(f"{'fp32 model, fp32 cache (reference)':<42} {ppl32:7.3f}")
    for name, dtype, sc in configs:
        logits = prefill_logits(model, ids, dtype, sc)
        if base is None:
            base = logits
        ppl, top1, kl = scores(logits, base, ids)
        _, top1_32, kl_32 = scores(logits, ref32, ids)
        d = (ppl / scores(base, base, ids)[0] - 1) * 100
        print(f"{name:<42} {ppl:7.3f} {d:+6.2f}% {top1:14.1%} {kl:11.5f} {top1_32:14.1%} {kl_32:11.5f}")


def capacity(model_dir: Path, memory: int) -> None:
    from kvstore.engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    print(f"\n== capacity at --kv-cache-memory {memory / 2**20:.0f} MiB ({cfg.model_name}, block {BLOCK}) ==")
    tokens = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        per = kv_bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype)
        tokens[name] = memory // per * BLOCK
        print(
            f"{name:<9}: {memory // per:6d} blocks = {tokens[name]:7d} tokens ({per * 1.0 / BLOCK / 1024:.1f} KiB/token)"
        )
    print(f"fp8 / bf16 tokens: {tokens['fp8'] / tokens['bfloat16']:.2f}x")


def throughput(
    model_dir: Path, rounds: int, num_prompts: int, input_len: int, output_len: int, seed: int
) -> None:
    from kvstore.engine import LLM, SamplingParams
    from kvstore.engine.bench.datasets import random_requests

    engines = {
        name: LLM(
            str(model_dir), dtype="bfloat16", kv_cache_dtype=kv, max_model_len=input_len + output_len + 16
        )
        for name, kv in (("bf16 cache", "auto"), ("fp8 cache", "fp8"))
    }
    vocab = next(iter(engines.values())).engine.model_config.vocab_size
    reqs = random_requests(vocab, num_prompts, input_len, output_len, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [r.prompt_token_ids for r in reqs]
    print(
        f"\n== throughput: {num_prompts} x {input_len} in -> {output_len} out, greedy, 1 thread, {rounds} rounds =="
    )
    for e in engines.values():
        e.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))
    res: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(rounds):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            e = engines[name]
            e.engine.block_manager.reset_prefix_cache()
            t = time.perf_counter()
            e.generate(prompts, params)
            res[name].append(num_prompts * output_len / (time.perf_counter() - t))
            print(f"  round {i + 1} {name}: {res[name][-1]:.1f} output tokens/s", flush=True)
    for name, v in res.items():
        print(f"{name}: median {np.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) output tokens/s")
    ratio = [a / b for a, b in zip(res["fp8 cache"], res["bf16 cache"], strict=True)]
    print(
        f"fp8 / bf16: {np.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}), median of per-round ratios"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: SmolLM2)")
    p.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from kvstore.engine.convert import ensure_smollm2

    model_dir = args.model or ensure_smollm2()
    capacity(model_dir, args.kv_cache_memory)
    if not args.skip_quality:
        quality(model_dir)
    if not args.skip_throughput:
        throughput(model_dir, args.rounds, args.num_prompts, args.input_len, args.output_len, args.seed)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
