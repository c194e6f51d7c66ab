"""TTFT of a prompt whose KV is a hit in the redis tier, per tier codec, and the bytes each hit moves.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_ttft.py                  # 4,096 tokens, 3 rounds
    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec_ttft.py --codecs raw kivi4 --rounds 5

One Valkey; per codec a kvstore-server with only a redis tier (`--tiers redis`) whose blobs are kept
in that codec (`--tier-codec redis=<codec>`; raw: none), each on its own Valkey database; one
SmolLM2 engine (bf16 weights and KV by default) per server with the kvstore connector (codec raw:
the server transcodes where a blob enters the tier, the connector decodes what it loads). Each
round, for each codec in turn (interleaved, never one codec's rounds first): a new random prompt is
computed cold (= recompute; its chunks are saved), the engine's prefix cache is emptied, and the same
prompt again is a redis hit. Prints medians [min..max] over rounds: cold and hit TTFT, the hit's
lookup / load (fetch, verify, decode, scatter) time by the connector's metrics, the hit TTFT vs raw's
in the same round and vs recompute, and the blob bytes loaded per request.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ttft import (  # noqa: E402
    LLM,
    Service,
    flush,
    kv_transfer,
    kvstore_server,
    random_prompt,
    seconds,
    spread,
    ttft,
    valkey,
)


def loaded_bytes(llm: LLM) -> float:
    c = llm.engine.scheduler.connector
    return c.metrics.snapshot().get("kvstore_connector_load_bytes_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=["raw", "int4", "kivi4", "kivi4+ans"])
    ap.add_argument("--dtype", default="bfloat16", help="the engine's weights and KV")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = ap.parse_args()
    services: list[Service] = []
    llms: dict[str, LLM] = {}
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in args.codecs}
    try:
        vk, redis_url = valkey()
        services.append(vk)
        base = redis_url.rsplit("/", 1)[0]
        for i, codec in enumerate(args.codecs):
            extra = [] if codec == "raw" else ["--tier-codec", f"redis={codec}"]
            svc, url = kvstore_server("--tiers", "redis", "--redis-url", f"{base}/{i}", *extra)
            services.append(svc)
            llms[codec] = LLM("smollm2", dtype=args.dtype, max_model_len=args.tokens + 16,
                              num_kv_blocks=args.tokens // 16 + 8, num_threads=args.threads,
                              kv_transfer_config=kv_transfer({"store_url": url}))  # fmt: skip
            ttft(llms[codec], random_prompt(64, 7 + i))  # warm-up
        for r in range(args.rounds):
            for i, codec in enumerate(args.codecs):
                llm, got = llms[codec], rows[codec]
                prompt = random_prompt(args.tokens, 1_000_003 * r + 101 * i + 5)
                cold = ttft(llm, prompt)
                flush(llm)
                llm.engine.block_manager.reset_prefix_cache()
                look0, load0, bytes0 = seconds(llm, "lookup"), seconds(llm, "load"), loaded_bytes(llm)
                hit = ttft(llm, prompt)
                for k, v in (("cold", cold), ("hit", hit), ("lookup", seconds(llm, "lookup") - look0),
                             ("load", seconds(llm, "load") - load0),
                             ("mib", (loaded_bytes(llm) - bytes0) / 2**20)):  # fmt: skip
                    got.setdefault(k, []).append(v)
                got.setdefault("vs_cold", []).append(hit / cold)
                if "raw" in rows and rows["raw"].get("hit"):
                    got.setdefault("vs_raw", []).append(hit / rows["raw"]["hit"][-1])
                print(f"round {r} {codec}: cold {cold * 1e3:.0f} ms, hit {hit * 1e3:.0f} ms, "
                      f"{got['mib'][-1]:.1f} MiB", flush=True)  # fmt: skip
    finally:
        for llm in llms.values():
            llm.shutdown()
        llms.clear()
        gc.collect()
        for s in reversed(services):
            s.stop()
    ms = "{:.0f}"
    print(f"\n== {args.tokens}-token prompt, redis-tier hit, SmolLM2-135M {args.dtype}, {args.rounds} rounds "
          "interleaved; medians [min..max] ==")  # fmt: skip
    print(
        "| redis tier codec | recompute (cold) ms | hit TTFT ms | lookup ms | load ms | hit / raw hit "
        "| hit / recompute | MiB loaded per request |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for codec, got in rows.items():
        vs_raw = spread(got["vs_raw"], "{:.2f}") if got.get("vs_raw") else "—"
        cells = [spread([v * 1e3 for v in got[k]], ms) for k in ("cold", "hit", "lookup", "load")]
        print(f"| {codec} | {' | '.join(cells)} | {vs_raw} | {spread(got['vs_cold'], '{:.3f}')} "
              f"| {statistics.median(got['mib']):.1f} |")  # fmt: skip


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
