"""Codec quality on a real model: size, perplexity change, top-1 agreement, KL, greedy agreement, speed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_quality.py              # SmolLM2 (engine.convert)
    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_quality.py --model DIR  # any HF Llama checkpoint dir

Modelled on the store: four long novel documents (this repository's own text, which no model has
seen: `DOCUMENTS`) are each prefilled in chunks of 256 tokens with a transformers `DynamicCache`,
fp32. After each chunk its KV — `[2, layers, 256, kv_heads, head_dim]` in the KV dtype (bfloat16 by
default, as the engine stores it) — goes through `encode_blob`/`decode_blob` with the codec and
replaces the cache's copy, so every later chunk attends to decoded KV while its own KV is still exact,
as with a store hit. Scored: every position from the second chunk on, against the same run with
full-precision fp32 KV: perplexity change, top-1 agreement of the next-token argmax, mean
KL(reference || codec) per position. Greedy: five novel prompts (`PROMPTS`, 512 tokens, their KV
through the codec) continued for 200 greedy tokens, against the reference continuation: the share of
the 200 positions with the same token, and where each prompt's first different token came (200: none).
Size: the mean blob size vs the KV dtype's bytes, header included. Speed: encode / decode GB/s of the
KV bytes of one real chunk, on 1 thread and on all (`--threads`; torch threads and
KVSTORE_CODEC_THREADS).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.blob import decode_blob, encode_blob

CONFIGS: list[tuple[str, str, dict]] = [
    ("raw (noise floor)", "raw", {}),
    ("fp8 e4m3, scale per token per head", "fp8", {}),
    ("int4 (id 2): K per channel g64, V per token g64, first token exact", "int4", {}),
    ("kivi4 DEFAULT: K per channel x 256 tokens, V per token x all heads, sink key", "kivi4", {}),
    ("kivi4 V per token per head (g64)", "kivi4", {"value_group": 64}),
    ("kivi4 K per channel x 128 tokens", "kivi4", {"key_tokens": 128}),
    ("kivi4 no sink key", "kivi4", {"sink_tokens": 0}),
    ("kivi2 DEFAULT: K per channel x 256 tokens, V per token x all heads, sink key", "kivi2", {}),
    ("kivi2 K x 64 tokens, V g64", "kivi2", {"key_tokens": 64, "value_group": 64}),
    ("kivi2 K x 32 tokens, V g32", "kivi2", {"key_tokens": 32, "value_group": 32}),
    ("kivi4+ans (default kivi4, then rANS)", "kivi4+ans", {}),
    ("kivi2+ans (default kivi2, then rANS)", "kivi2+ans", {}),
    ("kivi2+ans K x 64 tokens, V g64", "kivi2+ans", {"key_tokens": 64, "value_group": 64}),
    ("kivi2+ans K x 32 tokens, V g32", "kivi2+ans", {"key_tokens": 32, "value_group": 32}),
    ("fp8+ans", "fp8+ans", {}),
    ("int4+ans", "int4+ans", {}),
]
LOSSLESS = "+ans"  # a lossless stage: its quality is its base codec's (tested bit for bit), not re-run

# Novel text (written for this project, so no model has seen it): four long documents scored, five
# prompts continued; (file, first character). The run prints a digest of the texts it used.
DOCUMENTS = [("README.md", 0), ("README.md", 30000), ("kvstore/store.py", 0), ("engine/scheduler.py", 0)]
PROMPTS = [("README.md", 15000), ("README.md", 45000), ("engine/llm_engine.py", 0),
           ("connectors/kv_worker.py", 0), ("server/routes.py", 0)]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def load(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The model (fp32, eval) and its tokenizer."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def texts(tokenizer: Any, where: list[tuple[str, int]], tokens: int) -> tuple[list[torch.Tensor], str]:
    """`[1, tokens]` ids from each (file, offset), and a digest of the text used."""
    out, h = [], hashlib.sha256()
    for name, offset in where:
        text = (ROOT / name).read_text()[offset:]
        ids = tokenizer.encode(text).ids[:tokens]
        if len(ids) < tokens:
            raise SystemExit(f"{name} from {offset} has {len(ids)} tokens, fewer than {tokens}")
        h.update(tokenizer.decode(ids).encode())
        out.append(torch.tensor([ids]))
    return out, h.hexdigest()[:12]


def _cache_chunk(cache, start: int, stop: int) -> torch.Tensor:
    """The cache's KV of tokens [start, stop) in the store layout [2, L, T, H, D]."""
    keys = torch.stack([layer.keys[0, :, start:stop] for layer in cache.layers])  # [L, H, T, D]
    values = torch.stack([layer.values[0, :, start:stop] for layer in cache.layers])
    return torch.stack([keys, values]).transpose(2, 3)


def _set_cache_chunk(cache, start: int, stop: int, kv: torch.Tensor) -> None:
    kv = kv.transpose(2, 3).to(torch.float32)
    for i, layer in enumerate(cache.layers):
        layer.keys[0, :, start:stop] = kv[0, i]
        layer.values[0, :, start:stop] = kv[1, i]


@torch.no_grad()
def prefill_kv(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The fp32 KV `[2, L, T, H, D]` of one prefill."""
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return _cache_chunk(cache, 0, ids.shape[1])


@torch.no_grad()
def chunked_prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    chunk: int,
    codec: str | None,
    opts: dict,
    kv_dtype: torch.dtype,
) -> tuple[torch.Tensor, Any, list[float]]:
    """Logits `[N, vocab]` of a chunked prefill whose every full chunk's KV went through the codec
    once computed (as a store hit would give it back), the cache, and each blob's ratio vs the KV
    dtype (header included). codec None: the fp32 reference."""
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache(config=model.config)
    logits, ratios = [], []
    for start in range(0, ids.shape[1], chunk):
        stop = min(start + chunk, ids.shape[1])
        logits.append(model(input_ids=ids[:, start:stop], past_key_values=cache, use_cache=True).logits[0])
        if codec is not None and stop - start == chunk:
            kv = _cache_chunk(cache, start, stop).to(kv_dtype)
            blob = encode_blob(kv, codec=codec, **opts)
            ratios.append(kv.numel() * kv.element_size() / len(blob))
            _set_cache_chunk(cache, start, stop, decode_blob(blob))
    return torch.cat(logits), cache, ratios


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    ids: torch.Tensor,
    chunk: int,
    codec: str | None,
    opts: dict,
    kv_dtype: torch.dtype,
    n: int,
) -> list[int]:
    """`n` greedy tokens after the prompt `ids`, whose KV went through the codec chunk by chunk."""
    logits, cache, _ = chunked_prefill(model, ids, chunk, codec, opts, kv_dtype)
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(int(step.argmax()))
    return out


@torch.no_grad()
def chunks_kv(
    model: torch.nn.Module, ids: torch.Tensor, chunk: int, kv_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The exact KV of every full chunk of `ids`, in the KV dtype."""
    kv = prefill_kv(model, ids).to(kv_dtype)
    return [kv[:, :, a : a + chunk].contiguous() for a in range(0, ids.shape[1] - chunk + 1, chunk)]


def compare(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor, first: int) -> dict[str, float]:
    """nll of reference and codec, top-1 agreement and KL over the positions >= first that predict a
    next token (sums, so that documents add up; `n` positions)."""
    tgt = ids[0, first + 1 :]
    lr, lg = ref[first:-1].log_softmax(-1), got[first:-1].log_softmax(-1)
    return {
        "n": len(tgt),
        "nll_ref": -lr.gather(1, tgt[:, None]).sum().item(),
        "nll": -lg.gather(1, tgt[:, None]).sum().item(),
        "top1": (lr.argmax(-1) == lg.argmax(-1)).float().sum().item(),
        "kl": (lr.exp() * (lr - lg)).sum(-1).sum().item(),
    }


def speed(kv: torch.Tensor, codec: str, opts: dict, threads: int, reps: int = 5) -> tuple[float, float]:
    """(encode, decode) GB/s of the KV bytes on `threads` threads: the best of `reps` after a warm-up."""
    torch.set_num_threads(threads)
    os.environ["KVSTORE_CODEC_THREADS"] = str(threads)
    blob = encode_blob(kv, codec=codec, **opts)
    decode_blob(blob)
    enc = dec = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        blob = encode_blob(kv, codec=codec, **opts)
        enc = min(enc, time.perf_counter() - t)
        t = time.perf_counter()
        decode_blob(blob)
        dec = min(dec, time.perf_counter() - t)
    nbytes = kv.numel() * kv.element_size()
    return nbytes / enc / 1e9, nbytes / dec / 1e9


def default_model_dir() -> Path:
    from engine.convert import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="HF Llama checkpoint dir (default: SmolLM2 via engine.convert)"
    )
    ap.add_argument("--chunk", type=int, default=256, help="tokens per stored chunk")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each scored document")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each greedy prompt")
    ap.add_argument("--generate", type=int, default=200, help="greedy tokens per prompt")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--only", nargs="*", help="run only configurations whose name contains one of these")
    ap.add_argument(
        "--no-quality", action="store_true", help="sizes and speeds only (no model runs per codec)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="'all threads' for the speed columns")
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    model, tokenizer = load(model_dir)
    docs, ddigest = texts(tokenizer, DOCUMENTS, args.tokens // args.chunk * args.chunk)
    prompts, pdigest = texts(tokenizer, PROMPTS, args.prompt_tokens)
    kv_dtype = getattr(torch, args.kv_dtype)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    quality_docs = [] if args.no_quality else docs
    refs = [chunked_prefill(model, ids, args.chunk, None, {}, kv_dtype)[0] for ids in quality_docs]
    ref_tokens = [
        greedy(model, p, args.chunk, None, {}, kv_dtype, args.generate) for p in prompts[: len(refs)]
    ]
    base = [compare(r, r, ids, args.chunk) for r, ids in zip(refs, docs, strict=False)]
    n = sum(b["n"] for b in base) or 1
    speed_kv = prefill_kv(model, docs[0][:, : args.chunk])[:, :, : args.chunk].to(kv_dtype).contiguous()
    print(f"{model_dir.name}: {len(docs)} documents x {docs[0].shape[1]} tokens (texts {ddigest}), chunks of "
          f"{args.chunk}, KV {args.kv_dtype}, {n} scored positions, reference ppl "
          f"{math.exp(sum(b['nll_ref'] for b in base) / n):.3f}; {len(prompts)} prompts x {args.prompt_tokens} "
          f"tokens (texts {pdigest}) -> {args.generate} greedy tokens; speed on one "
          f"{list(speed_kv.shape)} chunk, 1 and {args.threads} threads ({time.perf_counter() - t:.0f} s "
          "for the reference)\n")  # fmt: skip
    print(
        "| scheme | size vs KV dtype | ppl change | top-1 | KL | greedy: same tokens | greedy: first miss "
        "| encode GB/s 1 / all | decode GB/s 1 / all |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    measured: dict[tuple[str, str], tuple] = {}
    for name, codec, opts in CONFIGS:
        if args.only and not any(s in name for s in args.only):
            continue
        torch.set_num_threads(args.threads)
        base = (codec.removesuffix(LOSSLESS), repr(sorted(opts.items())))
        if codec.endswith(LOSSLESS) or args.no_quality:  # quality: the base row's (lossless stage), or none
            ms, same, first = measured.get(base, (None, None, None))
            ratios = [
                kv.numel() * kv.element_size() / len(encode_blob(kv, codec=codec, **opts))
                for ids in docs
                for kv in chunks_kv(model, ids, args.chunk, kv_dtype)
            ]
        else:
            ms, ratios = [], []
            for ids, ref in zip(docs, refs, strict=True):
                got, _, r = chunked_prefill(model, ids, args.chunk, codec, opts, kv_dtype)
                ms.append(compare(ref, got, ids, args.chunk))
                ratios += r
            same, first = [], []
            for p, want in zip(prompts, ref_tokens, strict=True):
                got_tokens = greedy(model, p, args.chunk, codec, opts, kv_dtype, args.generate)
                same.append(sum(a == b for a, b in zip(want, got_tokens, strict=True)) / len(want))
                miss = [i for i, (a, b) in enumerate(zip(want, got_tokens, strict=True)) if a != b]
                first.append(miss[0] if miss else len(want))
            measured[(codec, base[1])] = ms, same, first
        e1, d1 = speed(speed_kv, codec, opts, 1)
        ea, da = speed(speed_kv, codec, opts, args.threads)
        if ms is None:
            quality = (f"as {base[0]}" if codec.endswith(LOSSLESS) else "—") + " | | | | "
        else:
            ppl = math.exp((sum(m["nll"] for m in ms) - sum(m["nll_ref"] for m in ms)) / n) - 1
            top1, kl = sum(m["top1"] for m in ms) / n, sum(m["kl"] for m in ms) / n
            quality = (f"{100 * ppl:+.2f}% | {100 * top1:.1f}% | {kl:.4f} | {100 * sum(same) / len(same):.0f}% "
                       f"| {sorted(first)}")  # fmt: skip
        print(f"| {name} | {sum(ratios) / len(ratios):.2f}x | {quality} | {e1:.2f} / {ea:.2f} | {d1:.2f} / {da:.2f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
