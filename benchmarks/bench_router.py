"""KV-aware routing on a slice of the public Mooncake conversation trace: 3 real SmolLM2 engines and one
kvstore-server behind `kvstore-engine router`, the policies interleaved round by round.

    flock /tmp/kvstore-heavy.lock .venv/bin/python benchmarks/bench_router.py            # a few minutes
    .venv/bin/python benchmarks/bench_router.py --conversations 8 --rounds 1              # a smoke run

The slice. From the first `--window` requests of `../shared/traces/mooncake_conversation_trace.jsonl`
the conversations are kept: requests that share their first two 512-token blocks (`hash_ids[:2]`;
block 0 is one system prompt shared by nearly every request) with another request of the window, in
trace order of their first turns. A round takes `--conversations` of them spread evenly over that
order (round r of R: the r-th of every R, at a stride of all / (conversations x R)), so that its
first turns arrive over the round as the trace's do (`--slice first`: the first ones, which all
begin within the trace's first seconds, a burst of cold prompts once time is compressed); every
policy replays the same round.

Baseline. `round_robin/no-store` is a second fleet of 3 engines with no KV connector (each its own
prefix cache only, as a fleet without kvstore) behind a second router, round robin, run in the same
rounds (`--no-store-baseline 0` leaves it out).

Peer. `sglang-router/cache_aware` is sglang-router (`--sglang-router PYTHON`: an interpreter with the
`sglang-router` package, by default `~/.cache/kvstore/sglang-router-venv/bin/python` when it exists; `none`
leaves it out) with its cache_aware policy in front of the same 3 engines and kvstore-server, one more
policy in the rounds. Its `/v1/completions` takes text prompts only (a list of token ids is a 422), so
while it runs every policy's prompt is the text of its token ids: sglang-router gets the text, the others
its ids as the engines' tokenizer reads it back (equal texts give equal ids, and the text of a prompt's
first blocks tokenizes to a prefix of the whole prompt's ids). It does not say which engine served a
request: its imbalance comes from the engines' own request counters.

Runs. `--runs N` starts the fleets anew N times and pools the rounds: ttft's TTFT p50 and p90 over each
other policy's are medians (and ranges) of per-round ratios over every round of every run.

Scaling. A 512-token block becomes `--block-tokens` tokens (32: SmolLM2 on 2 cores serves a 16-block
prompt, 512 tokens, in about a second instead of 8,192 tokens in minutes), drawn from a PRNG seeded
by (policy, block id), so equal id prefixes give equal token prefixes within a policy and no policy
reuses another's KV; prompts are cut at `--max-blocks` blocks and the last block to the scaled
input_length. The store's chunks are one scaled block (chunk_size = block tokens), as the trace's
blocks are the unit of reuse. Output: output_length / 64 tokens, 1 to 8.

Time. Arrivals keep the trace's order and relative times, compressed so that a round's requests
arrive at `--rps` on average; a conversation's next turn is never sent before its previous turn
finished (a user answers what they read), so the time compression cannot make a turn arrive before
its own history exists.

Per policy it prints: local hit rate (prompt tokens from the chosen engine's own prefix cache), store
hit rate (loaded from the kvstore-server), recompute share (the rest), TTFT p50 / p90 (client side,
streamed: request sent to first token), throughput (requests per second of round wall time) and load
imbalance (max / mean requests per engine); where the mean TTFT goes (before the request's first
prefill step: queued or loading; in prefill; outside the engines: router and HTTP) and the CPU seconds
the engine processes used; then ttft's TTFT p90 against each other's, over all requests and round by
round (the median and range of the rounds' ratios), and the CPU the routers,
the kvstore-server and this client used beside the engines, and what the rest of the box used
(other processes: fleet_sim.validate gives the simulated engines only the cores left). Hit rates come from the engines' own counters
(vllm:prefix_cache_hits, vllm:external_prefix_cache_hits over vllm:prompt_tokens), read before and
after each policy's part of a round, when nothing else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.engine.router.scoring import POLICIES  # noqa: E402
from kvstore.fleet_sim.conversations import (  # noqa: E402
    NO_STORE,
    TRACE,
    conversations,
    output_tokens,
    pct,
    prompt_tokens,
    rounds,
)

from tests.connectors.engine_util import free_port  # noqa: E402
from tests.router.fleet import router_state, start_engine, start_router, start_store, wait_healthy  # noqa: E402

SGLANG = "sglang-router/cache_aware"  # the peer: sglang-router in front of the same engines
SGLANG_PYTHON = Path.home() / ".cache" / "kvstore" / "sglang-router-venv" / "bin" / "python"
COUNTED = ("prompt", "local", "store", "ttft_s", "firsts", "prefill_s")  # engine counters summed per policy
VOCAB = (1000, 40000)  # SmolLM2 ids drawn from the ordinary part of its 49,152-token vocabulary


def prompt(
    row: dict, policy: str, block_tokens: int, max_blocks: int, vocab: tuple[int, int] = VOCAB
) -> list[int]:
    """The prompt's token ids (the slice's scaled length, kvstore.fleet_sim.conversations)."""
    out: list[int] = []
    for h in row["hash_ids"][:max_blocks]:
        rng = random.Random(f"{policy}:{h}")
        out += [rng.randrange(*vocab) for _ in range(block_tokens)]
    return out[: prompt_tokens(row, block_tokens, max_blocks)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def box_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every process, /proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def engine_counters(url: str) -> dict[str, float]:
    names = {"vllm:prompt_tokens_total": "prompt", "vllm:prefix_cache_hits_total": "local",
             "vllm:external_prefix_cache_hits_total": "store",
             "vllm:time_to_first_token_seconds_sum": "ttft_s", "vllm:time_to_first_token_seconds_count": "firsts",
             "vllm:request_prefill_time_seconds_sum": "prefill_s"}  # fmt: skip
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = dict.fromkeys(names.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def router_expected(url: str) -> dict[str, dict[str, float]]:
    """policy -> the router's expectation of where its requests' prompt tokens come from (source ->
    tokens: local, remote, miss), summed over the engines (kvstore_router_prompt_tokens)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvstore_router_prompt_tokens_total":
                out[s.labels["policy"]][s.labels["source"]] += s.value
    return out


async def one(session, router, policy, tokens, max_tokens, record, log=None, log_t0=0.0, model=None) -> None:
    """One streamed request; `tokens` a list of ids, or a text for sglang-router (with the `model` it
    needs); records (engine, TTFT), the engine None where the router does not say."""
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"X-KVStore-Policy": policy}
    if isinstance(tokens, str):
        body["model"], headers = model, {}
    sent = time.monotonic()
    ttft = None
    async with session.post(router + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        engine = r.headers.get("X-KVStore-Engine")
        decision = r.headers.get("X-KVStore-Decision")
        async for chunk in r.content.iter_any():
            if ttft is None and b"data:" in chunk:
                ttft = time.monotonic() - sent
    record.append((engine, ttft if ttft is not None else time.monotonic() - sent))
    if log is not None:
        log.write(json.dumps({"policy": policy, "sent_s": round(sent - log_t0, 3), "prompt_tokens": len(tokens),
                              "engine": engine, "ttft_s": round(record[-1][1], 4),
                              "decision": json.loads(decision) if decision else None}) + "\n")  # fmt: skip


async def run_round(router: str, policy: str, salt: str, convs: list[list[dict]], args) -> tuple[list, float]:
    rows = [r for c in convs for r in c]
    t0 = min(r["timestamp"] for r in rows)
    span_ms = max(r["timestamp"] for r in rows) - t0
    scale = (len(rows) / args.rps) / max(span_ms / 1000, 1e-9)  # trace seconds -> run seconds
    record: list = []
    start = time.monotonic()

    async def conversation(conv, session) -> None:
        for r in conv:
            due = start + (r["timestamp"] - t0) / 1000 * scale
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tokens = prompt(r, salt, args.block_tokens, args.max_blocks, args.vocab)
            if args.tokenizer is not None:  # sglang-router runs: its text, the others the text's ids
                text = args.tokenizer.decode(tokens)
                tokens = text if salt == SGLANG else args.tokenizer.encode(text, add_special_tokens=False)
            await one(session, router, policy, tokens, output_tokens(r), record, args.decisions_file, start,
                      args.served)  # fmt: skip

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(conversation(c, session) for c in convs))
    return record, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=1500, help="trace requests the conversations come from")
    p.add_argument("--conversations", type=int, default=12, help="conversations per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--slice", choices=("spread", "first"), default="spread", help="which conversations a round takes"
    )
    p.add_argument("--rps", type=float, default=1.5, help="mean arrival rate of a round (requests/s)")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per scaled 512-token trace block")
    p.add_argument("--max-blocks", type=int, default=24)
    p.add_argument("--kv-cache-memory", default="64MiB", help="each engine's KV cache")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--no-store-baseline", type=int, default=1, help="1: also run round_robin/no-store")
    p.add_argument("--decisions", type=Path, help="write each request's routing decision here (JSON lines: "
                   "policy, send time in its round, engine, TTFT, the router's X-KVStore-Decision)")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="the engines' model (a tiny one checks the plumbing)")
    p.add_argument("--max-model-len", default="1024")
    p.add_argument("--sglang-router", default=None, metavar="PYTHON",
                   help=f"an interpreter with sglang-router: its cache_aware policy is one more policy (default "
                        f"{SGLANG_PYTHON} when it exists; none: leave it out)")  # fmt: skip
    p.add_argument("--runs", type=int, default=1, help="start the fleets anew this many times, rounds pooled")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the figures here as JSON, {\"runs\": [one per run: its figures per policy, "
                        "the cores beside the engines, the router's costs]}: what kvstore.fleet_sim.validate reads")  # fmt: skip
    args = p.parse_args()
    args.vocab = VOCAB
    args.decisions_file = args.decisions.open("w") if args.decisions else None
    if args.model != "smollm2":
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        args.vocab = (min(VOCAB[0], vocab // 4), min(VOCAB[1], vocab))
    policies = args.policies.split(",") + ([NO_STORE] if args.no_store_baseline else [])
    args.sglang_python = sglang_python(args.sglang_router)
    args.tokenizer = args.served = None
    if args.sglang_python:
        policies.append(SGLANG)
        from kvstore.engine.convert import ensure_smollm2
        from kvstore.engine.tokenizer import Tokenizer

        model_dir = ensure_smollm2() if args.model == "smollm2" else Path(args.model)
        args.tokenizer = Tokenizer.from_pretrained(model_dir)
    plan = rounds(conversations(TRACE, args.window), args.conversations, args.rounds, args.slice)
    runs, written = [], []
    try:
        for run in range(args.runs):
            if args.runs > 1:
                print(f"\n=== run {run + 1} of {args.runs}", flush=True)
            results, summary = run_fleets(args, plan, policies)
            runs.append(results)
            written.append(summary)
    finally:
        if args.decisions_file is not None:
            args.decisions_file.close()
    if args.json:
        args.json.write_text(
            json.dumps({"benchmark": "bench_router", "argv": sys.argv[1:], "runs": written}, indent=1)
        )
    if args.runs > 1 or SGLANG in policies:
        pooled(args, policies, runs)
    return {"runs": [{pol: {"rounds": r[pol]["rounds"]} for pol in policies} for r in runs]}


def sglang_python(given: str | None) -> str | None:
    """The interpreter that runs sglang-router, or None (asked for none, or none installed)."""
    if given == "none":
        return None
    python = given or (str(SGLANG_PYTHON) if SGLANG_PYTHON.exists() else None)
    if python is None:
        print(f"sglang-router left out: no {SGLANG_PYTHON} (python -m venv {SGLANG_PYTHON.parents[1]} && "
              f"{SGLANG_PYTHON.parent}/pip install sglang-router==0.3.2), or name one with --sglang-router",
              file=sys.stderr)  # fmt: skip
    return python


def start_sglang(python: str, urls: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    """sglang-router with its cache_aware policy in front of `urls`; (process, URL) once /health answers."""
    port = free_port()
    log = (tmp / "sglang-router.log").open("w")
    proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy",
                             "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited: {(tmp / 'sglang-router.log').read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("sglang-router did not answer /health in 120 s")


def run_fleets(args, plan, policies) -> tuple[dict, dict]:
    """One run: the fleets started, every round of `plan` under every policy, the report printed, the
    fleets stopped; returns the per-policy results, and the run as --json writes it: the figures()
    ("policies"), the cores the rest of the box used during the rounds ("beside_cores": the routers,
    kvstore-server, this client and other processes) and the router's calibrated costs at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    ktc = json.dumps(
        {"kv_connector": "KVStoreConnector", "kv_connector_extra_config": {"chunk_size": args.block_tokens}}
    )
    store, store_cfg = start_store(tmp, "--cpu-capacity", "3GiB")
    procs = []
    sglang = None
    try:
        common = ("--model", args.model, "--max-model-len", args.max_model_len, "--kv-cache-memory",
                  args.kv_cache_memory)  # fmt: skip
        engines = [
            start_engine(tmp, f"e{i}", store.url, *common, "--kv-transfer-config", ktc) for i in range(3)
        ]
        if args.no_store_baseline:
            engines += [start_engine(tmp, f"n{i}", None, *common) for i in range(3)]
        procs += [e[0] for e in engines]
        for proc, url, _ in engines:
            wait_healthy(url, proc)
        router_args = ("--chunk-size", str(args.block_tokens), "--model", args.model)
        router_proc, router = start_router([(u, c) for _, u, c in engines[:3]], store_cfg, *router_args)
        procs.append(router_proc)
        fleets = {
            pol: (router, [u for _, u, _ in engines[:3]]) for pol in policies if pol not in (NO_STORE, SGLANG)
        }
        sglang = None
        if SGLANG in policies:
            sglang, sglang_url = start_sglang(args.sglang_python, [u for _, u, _ in engines[:3]], tmp)
            fleets[SGLANG] = (sglang_url, [u for _, u, _ in engines[:3]])
            args.served = json.loads(urllib.request.urlopen(engines[0][1] + "/v1/models", timeout=30).read())[
                "data"][0]["id"]  # fmt: skip
        if args.no_store_baseline:
            proc, bare = start_router([(u, c) for _, u, c in engines[3:]], None, *router_args)
            procs.append(proc)
            fleets[NO_STORE] = (bare, [u for _, u, _ in engines[3:]])
        beside = [store.proc.pid] + [proc.proc.pid for proc in procs[len(engines) :]]  # server, routers
        beside += [sglang.pid] if sglang is not None else []
        engine_pids = [proc.proc.pid for proc, _, _ in engines]
        overhead = {"cpu": 0.0, "box": 0.0, "wall": 0.0}  # ours beside the engines; all but the engines
        results = {
            pol: {
                "records": [],
                "rounds": [],
                "wall": 0.0,
                "engine_cpu_s": 0.0,
                "per_engine": collections.Counter(),  # requests each engine counted (first tokens)
                **dict.fromkeys(COUNTED, 0.0),
            }
            for pol in policies
        }
        for rnd, chunk in enumerate(plan):
            order = policies[rnd % len(policies) :] + policies[: rnd % len(policies)]
            for pol in order:
                url, urls = fleets[pol]
                before = [engine_counters(u) for u in urls]
                cpu0 = sum(map(cpu_s, beside)) + time.process_time()
                engines0 = sum(cpu_s(proc.proc.pid) for proc, u, _ in engines if u in urls)
                box0 = box_busy_s() - sum(map(cpu_s, engine_pids))
                record, wall = asyncio.run(run_round(url, pol.split("/")[0], pol, chunk, args))
                overhead["cpu"] += sum(map(cpu_s, beside)) + time.process_time() - cpu0
                overhead["box"] += box_busy_s() - sum(map(cpu_s, engine_pids)) - box0
                overhead["wall"] += wall
                engines_cpu = sum(cpu_s(proc.proc.pid) for proc, u, _ in engines if u in urls) - engines0
                time.sleep(1.0)  # the last saves reach the store, the last counters the scrape
                after = [engine_counters(u) for u in urls]
                res = results[pol]
                res["records"] += record
                res["rounds"].append([t for _, t in record])
                res["wall"] += wall
                res["engine_cpu_s"] += engines_cpu
                for k in COUNTED:
                    res[k] += sum(a[k] - b[k] for a, b in zip(after, before, strict=True))
                for u, a, b in zip(urls, after, before, strict=True):
                    res["per_engine"][u] += a["firsts"] - b["firsts"]
                print(f"round {rnd + 1} {pol:>26}: {len(record)} requests in {wall:.1f} s", file=sys.stderr)
        got = report(args, plan, policies, results, fleets)
        w = overhead["wall"]
        print(f"CPU beside the engines in {w:.1f} s of rounds: the routers, kvstore-server and this client "
              f"{overhead['cpu'] / w:.2f} cores, the rest of the box {(overhead['box'] - overhead['cpu']) / w:.2f}; "
              f"in all {overhead['box'] / w:.2f} cores")  # fmt: skip
        expected = router_expected(router)  # the router's index against what the engines reported
        for pol in policies:
            e = expected.get(pol.split("/")[0]) if pol not in (NO_STORE, SGLANG) else None
            if e and sum(e.values()):
                n = sum(e.values())
                print(f"{pol}: the router expected local {e['local'] / n:.1%}, store {e['remote'] / n:.1%}, "
                      f"computed {e['miss'] / n:.1%} of its prompt tokens")  # fmt: skip
        costs = router_state(router)["costs"]
        print(
            "the router's calibrated costs at the end: " + ", ".join(f"{k} {v:.3g}" for k, v in costs.items())
        )
        return results, {"policies": got, "beside_cores": overhead["box"] / w, "costs": costs}
    finally:
        if sglang is not None:
            sglang.terminate()
            sglang.wait(timeout=30)
        for proc in procs:
            proc.stop()
        store.stop()


def figures(policies, results, fleets) -> dict[str, dict[str, float]]:
    """Per policy what the table shows (and --json writes): local, store (shares of the prompt tokens),
    p50, p90 (TTFT, s), rps, imbalance; where its engines counted first tokens, where the mean TTFT
    went, s: before (its first prefill step: queued, loading), prefill, outside (the engines: router,
    HTTP), and cpu (the engine processes' CPU seconds in its rounds)."""
    out = {}
    for pol in policies:
        res = results[pol]
        ttfts = [t for _, t in res["records"]]
        per_engine = collections.Counter(e for e, _ in res["records"])
        if None in per_engine:  # the router did not name its engines: their own counts
            per_engine = res["per_engine"]
        counts = [per_engine.get(u, 0) for u in fleets[pol][1]]
        out[pol] = {"local": res["local"] / res["prompt"], "store": res["store"] / res["prompt"],
                    "p50": statistics.median(ttfts), "p90": pct(ttfts, 0.9), "rps": len(ttfts) / res["wall"],
                    "imbalance": max(counts) / statistics.mean(counts)}  # fmt: skip
        if res["firsts"]:
            inside, prefill = res["ttft_s"] / res["firsts"], res["prefill_s"] / res["firsts"]
            client = statistics.mean(ttfts)
            out[pol].update(
                before=inside - prefill, prefill=prefill, outside=client - inside, cpu=res["engine_cpu_s"]
            )
    return out


def report(args, plan, policies, results, fleets) -> dict[str, dict[str, float]]:
    """Prints the run's tables; returns its figures()."""
    n = sum(len(c) for chunk in plan for c in chunk)
    print(f"\nMooncake conversation trace, {args.rounds} rounds x {args.conversations} conversations ({args.slice}; "
          f"{n} requests per policy), {args.block_tokens} tokens per 512-token block, {args.rps} req/s, "
          f"3 engines (KV cache {args.kv_cache_memory} each) + 1 kvstore-server\n")  # fmt: skip
    print(f"{'policy':>26} {'local hit':>9} {'store hit':>9} {'recompute':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'req/s':>6} {'imbalance':>9}")  # fmt: skip
    got = figures(policies, results, fleets)
    p90 = {pol: f["p90"] for pol, f in got.items()}
    for pol, f in got.items():
        print(f"{pol:>26} {f['local']:>9.1%} {f['store']:>9.1%} {1 - f['local'] - f['store']:>9.1%} {f['p50']:>8.3f}s "
              f"{f['p90']:>8.3f}s {f['rps']:>6.2f} {f['imbalance']:>9.2f}")  # fmt: skip
    print(
        "\nwhere a request's TTFT goes, mean seconds (the engines' histograms): before its first prefill step "
        "(queued, loading), in prefill, outside the engines (router, HTTP); the CPU seconds the engine "
        "processes used in the policy's rounds"
    )
    for pol, f in got.items():
        if "before" in f:
            print(f"{pol:>26} before prefill {f['before']:.3f}s  prefill {f['prefill']:.3f}s  outside {f['outside']:.3f}s"
                  f"  engines' CPU {f['cpu']:.1f}s")  # fmt: skip
    if "ttft" in p90:
        ratios = ", ".join(f"{p90['ttft'] / v:.2f}x {pol}'s" for pol, v in p90.items() if pol != "ttft")
        print(f"\nttft's TTFT p90 (all rounds' requests): {ratios}")
        print("ttft's TTFT p50 and p90 round by round, median (min-max) of the rounds' ratios:")
        for pol in policies:
            if pol != "ttft":
                print(f"  / {pol:<26} {_ratios(results['ttft']['rounds'], results[pol]['rounds'])}")


def _ratios(ours: list[list[float]], theirs: list[list[float]]) -> str:
    """'p50 M× (lo-hi), p90 M× (lo-hi)': medians and ranges of per-round ratios of TTFT quantiles."""
    out = []
    for q in (0.5, 0.9):
        r = [pct(t, q) / pct(b, q) for t, b in zip(ours, theirs, strict=True)]
        out.append(f"p{round(q * 100)} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
    return ", ".join(out)


def pooled(args, policies, runs) -> None:
    """ttft against every other policy over every round of every run."""
    if "ttft" not in policies:
        return
    n = sum(len(r["ttft"]["rounds"]) for r in runs)
    print(f"\nttft's TTFT over each policy's, {len(runs)} run(s) x {args.rounds} rounds = {n} rounds pooled: "
          f"median (min-max) of the per-round ratios")  # fmt: skip
    for pol in policies:
        if pol != "ttft":
            ours = [t for r in runs for t in r["ttft"]["rounds"]]
            theirs = [t for r in runs for t in r[pol]["rounds"]]
            print(f"  / {pol:<26} {_ratios(ours, theirs)}")


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
