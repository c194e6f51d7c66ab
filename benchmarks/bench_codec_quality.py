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
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.blob import decode_blob, encode_blob

K256 = {"key_tokens": 256, "key_meta": "fp16"}  # kivi4's default key groups before the 8-bit ones
OLD = {"value_meta": "fp16", "rotate_values": False}  # the value metadata before the defaults
OLD4 = {**K256, **OLD}  # kivi4 as the rows measured before either default ran
K64 = {"key_tokens": 64, "key_meta": "8bit"}
CONFIGS: list[tuple[str, str, dict]] = [
    ("raw (noise floor)", "raw", {}),
    ("fp8 e4m3, scale per token per head", "fp8", {}),
    ("int4 (id 2): K per channel g64, V per token g64, first token exact", "int4", {}),
    (
        "kivi4 DEFAULT: K per channel x 128 tokens, 8-bit K and V metadata, V per token per head, Hadamard",
        "kivi4",
        {},
    ),
    ("kivi4 V per token per head, fp16 V metadata", "kivi4", OLD4),
    ("kivi4 K x 256 tokens, fp16 K metadata (the default before 8-bit K metadata)", "kivi4", K256),
    ("kivi4 K x 64 tokens, 8-bit K metadata", "kivi4", K64),
    ("kivi4 V per token x all heads, fp16 V metadata", "kivi4", {"value_group": "row", **OLD4}),
    ("kivi4 K x 128 tokens, V x all heads, fp16", "kivi4", {**OLD4, "key_tokens": 128, "value_group": "row"}),
    ("kivi4 no sink key, V x all heads, fp16", "kivi4", {"sink_tokens": 0, "value_group": "row", **OLD4}),
    (
        "kivi2 DEFAULT: K per channel x 64 tokens, V per token per head, Hadamard, 8-bit V metadata",
        "kivi2",
        {},
    ),
    ("kivi2 K x 256 tokens, V x all heads, fp16", "kivi2", {"key_tokens": 256, "value_group": "row", **OLD}),
    ("kivi2 K x 64 tokens, V g64, fp16", "kivi2", {"key_tokens": 64, "value_group": 64, **OLD}),
    ("kivi2 K x 32 tokens, V g32, fp16", "kivi2", {"key_tokens": 32, "value_group": 32, **OLD}),
    ("kivi4+ans (the kivi4 default, then rANS)", "kivi4+ans", {}),
    ("kivi4+ans, V fp16 metadata", "kivi4+ans", OLD4),
    ("kivi4+ans K x 256 tokens, fp16 K metadata (the earlier default)", "kivi4+ans", K256),
    ("kivi4+ans K x 64 tokens, 8-bit K metadata", "kivi4+ans", K64),
    ("kivi2+ans (the kivi2 default, then rANS)", "kivi2+ans", {}),
    ("kivi2+ans K x 32 tokens, V g32, fp16", "kivi2+ans", {"key_tokens": 32, "value_group": 32, **OLD}),
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
# the texts as they were at this commit (the files keep changing), read with git; the working tree's
# files where git or the commit is not there (the printed digest then differs)
TEXTS_AT = "b4bd2a9"
# The earlier scored text (public domain, so no longer novel to any model): bench_kv_cache_dtype.py and
# bench_codecs.py --model still read it.
TEXT = """The Declaration of Independence of the United States of America, 1776.

When in the Course of human events, it becomes necessary for one people to dissolve the political bands which have connected them with another, and to assume among the powers of the earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving their just powers from the consent of the governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, laying its foundation on such principles and organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that Governments long established should not be changed for light and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute Despotism, it is their right, it is their duty, to throw off such Government, and to provide new Guards for their future security. Such has been the patient sufferance of these Colonies; and such is now the necessity which constrains them to alter their former Systems of Government. The history of the present King of Great Britain is a history of repeated injuries and usurpations, all having in direct object the establishment of an absolute Tyranny over these States. To prove this, let Facts be submitted to a candid world.

He has refused his Assent to Laws, the most wholesome and necessary for the public good. He has forbidden his Governors to pass Laws of immediate and pressing importance, unless suspended in their operation till his Assent should be obtained; and when so suspended, he has utterly neglected to attend to them. He has refused to pass other Laws for the accommodation of large districts of people, unless those people would relinquish the right of Representation in the Legislature, a right inestimable to them and formidable to tyrants only. He has called together legislative bodies at places unusual, uncomfortable, and distant from the depository of their public Records, for the sole purpose of fatiguing them into compliance with his measures. He has dissolved Representative Houses repeatedly, for opposing with manly firmness his invasions on the rights of the people. He has refused for a long time, after such dissolutions, to cause others to be elected; whereby the Legislative powers, incapable of Annihilation, have returned to the People at large for their exercise; the State remaining in the mean time exposed to all the dangers of invasion from without, and convulsions within. He has endeavoured to prevent the population of these States; for that purpose obstructing the Laws for Naturalization of Foreigners; refusing to pass others to encourage their migrations hither, and raising the conditions of new Appropriations of Lands. He has obstructed the Administration of Justice, by refusing his Assent to Laws for establishing Judiciary powers. He has made Judges dependent on his Will alone, for the tenure of their offices, and the amount and payment of their salaries. He has erected a multitude of New Offices, and sent hither swarms of Officers to harrass our people, and eat out their substance. He has kept among us, in times of peace, Standing Armies without the Consent of our legislatures. He has affected to render the Military independent of and superior to the Civil power.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other way -- in short, the period was so far like the present period, that some of its noisiest authorities insisted on its being received, for good or for evil, in the superlative degree of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general were settled for ever.

Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand of me, that it requires a strong moral principle to prevent me from deliberately stepping into the street, and methodically knocking people's hats off -- then, I account it high time to get to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. There is nothing surprising in this. If they but knew it, almost all men in their degree, some time or other, cherish very nearly the same feelings towards the ocean with me.

There now is your insular city of the Manhattoes, belted round by wharves as Indian isles by coral reefs -- commerce surrounds it with her surf. Right and left, the streets take you waterward. Its extreme downtown is the battery, where that noble mole is washed by waves, and cooled by breezes, which a few hours previous were out of sight of land. Look at the crowds of water-gazers there. Circumambulate the city of a dreamy Sabbath afternoon. Go from Corlears Hook to Coenties Slip, and from thence, by Whitehall, northward. What do you see? Posted like silent sentinels all around the town, stand thousands upon thousands of mortal men fixed in ocean reveries. Some leaning against the spiles; some seated upon the pier-heads; some looking over the bulwarks of ships from China; some high aloft in the rigging, as if striving to get a still better seaward peep. But these are all landsmen; of week days pent up in lath and plaster -- tied to counters, nailed to benches, clinched to desks. How then is this? Are the green fields gone? What do they here?

Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place for those who here gave their lives that that nation might live. It is altogether fitting and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add. The world will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.
"""


def load(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The model (fp32, eval) and its tokenizer."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _read(name: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{TEXTS_AT}:{name}"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return (ROOT / name).read_text()


def texts(tokenizer: Any, where: list[tuple[str, int]], tokens: int) -> tuple[list[torch.Tensor], str]:
    """`[1, tokens]` ids from each (file, offset), and a digest of the text used."""
    out, h = [], hashlib.sha256()
    for name, offset in where:
        text = _read(name)[offset:]
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
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

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
        greedy(model, p, args.chunk, None, {}, kv_dtype, args.generate) for p in (prompts if refs else [])
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
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
