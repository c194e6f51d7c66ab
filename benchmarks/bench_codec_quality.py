"""Codec quality on a real model: perplexity change, top-1 agreement and KL per codec configuration.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_quality.py              # SmolLM2 (engine.convert)
    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_quality.py --model DIR  # any HF Llama checkpoint dir

Modelled on the store: a fixed public-domain text (the Declaration of Independence, Dickens, Melville,
Lincoln; ~1,800 tokens for SmolLM2) is prefilled in chunks of 256 tokens with a transformers
`DynamicCache`, fp32. After each chunk its KV — `[2, layers, 256, kv_heads, head_dim]` in the KV
dtype (float16 by default, as the engine stores it) — goes through `encode_blob`/`decode_blob` with
the codec and replaces the cache's copy, so every later chunk attends to decoded KV while its own KV
is still exact, as with a store hit. Scored: every position from the second chunk on, against the
same run with full-precision fp32 KV. Printed per configuration: size vs fp16, perplexity change,
top-1 agreement of the next-token argmax, and mean KL(reference || codec) per position.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from kvstore.blob import decode_blob, encode_blob

CONFIGS: list[tuple[str, str, dict]] = [
    ("raw fp16 (noise floor)", "raw", {}),
    ("fp8 e4m3, scale per token per head", "fp8", {}),
    ("fp8 e4m3, scale per tensor", "fp8", {"fp8_scale": "tensor"}),
    ("int4 DEFAULT: K per channel g64, V per token g64, sink 1", "int4", {}),
    ("int4 K per channel g64, V g64, no sink", "int4", {"sink_tokens": 0}),
    ("int4 K per channel g128, V g64, sink 1", "int4", {"key_group_size": 128}),
    ("int4 K per channel g32, V g32, sink 1", "int4", {"group_size": 32}),
    ("int4 K per token g64 + Hadamard, V g64 + Hadamard, sink 1", "int4", {"keys": "token", "rotate": True}),
    ("int4 K per token g64, V g64, no sink (naive)", "int4", {"keys": "token", "sink_tokens": 0}),
]

TEXT = """The Declaration of Independence of the United States of America, 1776.

When in the Course of human events, it becomes necessary for one people to dissolve the political bands which have connected them with another, and to assume among the powers of the earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving their just powers from the consent of the governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, laying its foundation on such principles and organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that Governments long established should not be changed for light and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute Despotism, it is their right, it is their duty, to throw off such Government, and to provide new Guards for their future security. Such has been the patient sufferance of these Colonies; and such is now the necessity which constrains them to alter their former Systems of Government. The history of the present King of Great Britain is a history of repeated injuries and usurpations, all having in direct object the establishment of an absolute Tyranny over these States. To prove this, let Facts be submitted to a candid world.

He has refused his Assent to Laws, the most wholesome and necessary for the public good. He has forbidden his Governors to pass Laws of immediate and pressing importance, unless suspended in their operation till his Assent should be obtained; and when so suspended, he has utterly neglected to attend to them. He has refused to pass other Laws for the accommodation of large districts of people, unless those people would relinquish the right of Representation in the Legislature, a right inestimable to them and formidable to tyrants only. He has called together legislative bodies at places unusual, uncomfortable, and distant from the depository of their public Records, for the sole purpose of fatiguing them into compliance with his measures. He has dissolved Representative Houses repeatedly, for opposing with manly firmness his invasions on the rights of the people. He has refused for a long time, after such dissolutions, to cause others to be elected; whereby the Legislative powers, incapable of Annihilation, have returned to the People at large for their exercise; the State remaining in the mean time exposed to all the dangers of invasion from without, and convulsions within. He has endeavoured to prevent the population of these States; for that purpose obstructing the Laws for Naturalization of Foreigners; refusing to pass others to encourage their migrations hither, and raising the conditions of new Appropriations of Lands. He has obstructed the Administration of Justice, by refusing his Assent to Laws for establishing Judiciary powers. He has made Judges dependent on his Will alone, for the tenure of their offices, and the amount and payment of their salaries. He has erected a multitude of New Offices, and sent hither swarms of Officers to harrass our people, and eat out their substance. He has kept among us, in times of peace, Standing Armies without the Consent of our legislatures. He has affected to render the Military independent of and superior to the Civil power.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other way -- in short, the period was so far like the present period, that some of its noisiest authorities insisted on its being received, for good or for evil, in the superlative degree of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general were settled for ever.

Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand of me, that it requires a strong moral principle to prevent me from deliberately stepping into the street, and methodically knocking people's hats off -- then, I account it high time to get to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. There is nothing surprising in this. If they but knew it, almost all men in their degree, some time or other, cherish very nearly the same feelings towards the ocean with me.

There now is your insular city of the Manhattoes, belted round by wharves as Indian isles by coral reefs -- commerce surrounds it with her surf. Right and left, the streets take you waterward. Its extreme downtown is the battery, where that noble mole is washed by waves, and cooled by breezes, which a few hours previous were out of sight of land. Look at the crowds of water-gazers there. Circumambulate the city of a dreamy Sabbath afternoon. Go from Corlears Hook to Coenties Slip, and from thence, by Whitehall, northward. What do you see? Posted like silent sentinels all around the town, stand thousands upon thousands of mortal men fixed in ocean reveries. Some leaning against the spiles; some seated upon the pier-heads; some looking over the bulwarks of ships from China; some high aloft in the rigging, as if striving to get a still better seaward peep. But these are all landsmen; of week days pent up in lath and plaster -- tied to counters, nailed to benches, clinched to desks. How then is this? Are the green fields gone? What do they here?

Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place for those who here gave their lives that that nation might live. It is altogether fitting and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add. The world will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.
"""


def load(model_dir: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (fp32, eval) and the token ids of TEXT as `[1, N]`."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT).ids
    return model, torch.tensor([ids])


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
    model(input_ids=ids, cache=cache, use_cache=True)
    return _cache_chunk(cache, 0, ids.shape[1])


@torch.no_grad()
def chunked_logits(
    model: torch.nn.Module,
    ids: torch.Tensor,
    chunk: int,
    codec: str | None,
    opts: dict,
    kv_dtype: torch.dtype,
) -> tuple[torch.Tensor, float]:
    """Logits `[N, vocab]` of a chunked prefill whose earlier chunks' KV went through the codec;
    and the mean size ratio fp16 / blob. codec None: the fp32 reference."""
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache(config=model.config)
    logits, ratios = [], []
    for start in range(0, ids.shape[1], chunk):
        stop = min(start + chunk, ids.shape[1])
        logits.append(model(input_ids=ids[:, start:stop], cache=cache, use_cache=True).logits[0])
        if codec is not None:
            kv = _cache_chunk(cache, start, stop).to(kv_dtype)
            blob = encode_blob(kv, codec=codec, **opts)
            ratios.append(kv.numel() * 2 / len(blob))
            _set_cache_chunk(cache, start, stop, decode_blob(blob))
    return torch.cat(logits), (sum(ratios) / len(ratios) if ratios else 1.0)


def compare(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor, first: int) -> dict[str, float]:
    """ppl change, top-1 agreement and KL over the positions >= first that predict a next token."""
    tgt = ids[0, first + 1 :]
    lr, lg = ref[first:-1].log_softmax(-1), got[first:-1].log_softmax(-1)
    nll_r = -lr.gather(1, tgt[:, None]).mean().item()
    nll_g = -lg.gather(1, tgt[:, None]).mean().item()
    return {
        "ppl": math.exp(nll_r),
        "ppl_change": math.exp(nll_g - nll_r) - 1,
        "top1": (lr.argmax(-1) == lg.argmax(-1)).float().mean().item(),
        "kl": (lr.exp() * (lr - lg)).sum(-1).mean().item(),
    }


def default_model_dir() -> Path:
    from engine.convert import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="HF Llama checkpoint dir (default: SmolLM2 via engine.convert)"
    )
    ap.add_argument("--chunk", type=int, default=256, help="tokens per stored chunk")
    ap.add_argument("--tokens", type=int, default=2048, help="use at most this many tokens of the text")
    ap.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--only", nargs="*", help="run only configurations whose name contains one of these")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = args.model or default_model_dir()
    model, ids = load(model_dir)
    n = min(ids.shape[1], args.tokens) // args.chunk * args.chunk
    if n < 2 * args.chunk:
        raise SystemExit(f"the text has {ids.shape[1]} tokens: too few for two chunks of {args.chunk}")
    ids = ids[:, :n]
    kv_dtype = getattr(torch, args.kv_dtype)
    t = time.perf_counter()
    ref, _ = chunked_logits(model, ids, args.chunk, None, {}, kv_dtype)
    scored = n - args.chunk - 1
    print(f"{model_dir.name}: {n} tokens, chunks of {args.chunk}, KV {args.kv_dtype}, {scored} scored positions, "
          f"reference ppl {compare(ref, ref, ids, args.chunk)['ppl']:.3f} ({time.perf_counter() - t:.0f} s per run)\n")  # fmt: skip
    print("| scheme | size vs fp16 | ppl change | top-1 agreement | KL |")
    print("|---|---|---|---|---|")
    for name, codec, opts in CONFIGS:
        if args.only and not any(s in name for s in args.only):
            continue
        got, ratio = chunked_logits(model, ids, args.chunk, codec, opts, kv_dtype)
        m = compare(ref, got, ids, args.chunk)
        print(f"| {name} | {ratio:.2f}x | {100 * m['ppl_change']:+.2f}% | {100 * m['top1']:.1f}% | {m['kl']:.5f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
