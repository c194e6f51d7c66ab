"""What a write through the fleet's Valkey Cluster costs: the redis tier's put with and without
`wait_replicas=1` (WAIT 1: acknowledged once the primary's replica has it), on a 3 primaries +
3 replicas Cluster on loopback that this script starts and stops.

    python benchmarks/bench_fleet.py [--sizes-kib 64 1024] [--puts 300] [--rounds 3]

For each blob size, rounds alternate the two settings (the noise of a shared box hits both alike)
and time single-blob puts and batches of 8 (one pipeline per primary, plus its WAIT). Prints p50 /
p90 in ms and the WAIT/none ratio. Writes JSON to ~/.cache/kvstore/bench/fleet-wait.json.

    python benchmarks/bench_fleet.py --engines [--rounds 3] [--users 4] [--turns 3] [--engine-counts 2 4]

The engine part: two kvstore-servers (tiers cpu + redis, one prefix on the Cluster) and, for each
engine count E, two sets of E in-process SmolLM2 engines (CPU): "E e x 1 s" has all on server 1,
"E e x 2 s" engine i on server i % 2. Every round runs every configuration (the order reversed every
round), each a fresh workload: 2 shared 512-token system prompts, per-user histories (prompts
612-1,112 tokens, 4-token answers), a user's turns round robin over the engines. Each request runs
alone and is classified by where most of its reused prefix came from: the engine's own prefix cache,
its server's cpu tier, the redis tier (the Cluster; with 2 servers mostly written through the other
server), or none (recomputed). Prints per configuration the token hit rate per tier, TTFT p50/p90
per class, the bytes through the Cluster per request, each against the first configuration, and per
engine count the TTFT ratios cross-server hit / same-server hit / local hit / recompute, all as
medians of per-round ratios (min-max). Writes ~/.cache/kvstore/bench/fleet-engines.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.engine import LLM, SamplingParams  # noqa: E402
from kvstore.sdk.remote import RemoteBackend  # noqa: E402

from kvstore.tiers.redis import RedisTier  # noqa: E402
from tests.connectors.conftest import ServerProcess  # noqa: E402
from tests.connectors.engine_util import doc, store_metrics  # noqa: E402
from tests.valkey import ValkeyCluster  # noqa: E402

HITS = "vllm:external_prefix_cache_hits_total"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_puts(tier: RedisTier, blob: bytes, n: int, batch: int) -> list[float]:
    """Seconds per put call (`batch` blobs each), fresh keys every call."""
    out = []
    for _ in range(n // batch):
        items = [(uuid.uuid4().hex, blob) for _ in range(batch)]
        t = time.perf_counter()
        if batch == 1:
            tier.put(*items[0])
        else:
            tier.put_many(items)
        out.append(time.perf_counter() - t)
    return out


def main() -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--puts", type=int, default=300, help="blobs per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", action="store_true", help="the engine part instead (see the docstring)")
    ap.add_argument("--users", type=int, default=4, help="--engines: users per round and configuration")
    ap.add_argument("--turns", type=int, default=3, help="--engines: turns per user")
    ap.add_argument(
        "--engine-counts", type=int, nargs="+", default=[2, 4],
        help="--engines: engines per configuration, each on 1 and on 2 servers",
    )  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.engines:
        return engines_main(args)
    results = []
    with ValkeyCluster(3, replicas=1) as cluster:
        cluster.wait_replicas()
        tiers = {w: RedisTier(cluster.urls, prefix=f"b{w}:", cluster=True, wait_replicas=w) for w in (0, 1)}
        try:
            for kib in args.sizes_kib:
                blob = os.urandom(kib * 1024)
                for batch in (1, 8):
                    times: dict[int, list[float]] = {0: [], 1: []}
                    for _ in range(args.rounds):
                        for w, tier in tiers.items():
                            times[w] += time_puts(tier, blob, args.puts, batch)
                        for tier in tiers.values():  # keep memory flat between rounds
                            for k in list(tier.keys()):
                                tier.delete(k)
                    row = {"kib": kib, "batch": batch}
                    for w in (0, 1):
                        row[f"p50_ms_wait{w}"] = 1000 * statistics.median(times[w])
                        row[f"p90_ms_wait{w}"] = 1000 * pct(times[w], 0.9)
                    row["p50_ratio"] = row["p50_ms_wait1"] / row["p50_ms_wait0"]
                    results.append(row)
        finally:
            for tier in tiers.values():
                tier.close()
    print(
        f"{'blob':>8} {'batch':>5} {'p50 none':>9} {'p50 WAIT 1':>11} {'p90 none':>9} {'p90 WAIT 1':>11} {'p50 ratio':>9}"
    )
    for r in results:
        print(f"{r['kib']:>5}KiB {r['batch']:>5} {r['p50_ms_wait0']:>7.3f}ms {r['p50_ms_wait1']:>9.3f}ms "
              f"{r['p90_ms_wait0']:>7.3f}ms {r['p90_ms_wait1']:>9.3f}ms {r['p50_ratio']:>8.2f}x")  # fmt: skip
    out = Path.home() / ".cache/kvstore/bench/fleet-wait.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return None


# --- the engine part (--engines): SmolLM2 engines on 1 vs 2 servers sharing the Cluster -----------

CHUNK = 256  # the connector's default chunk_size (tokens per stored chunk)
CLASSES = ("engine", "server cpu", "redis", "none")


@dataclass
class Fleet:
    """One configuration: its engines, each attached to a server (engine i to server i % servers)."""

    name: str
    engines: list  # engine.LLM, one per entry of `servers`
    servers: list[RemoteBackend]


def server_counts(servers: list[RemoteBackend]) -> dict[str, int]:
    """Summed over the distinct servers: cpu/redis hits and the bytes through the redis tier."""
    out = {"cpu": 0, "redis": 0, "redis_bytes": 0}
    for s in {id(s): s for s in servers}.values():
        for t in s.stats()["tiers"]:
            if t["name"] in ("cpu", "redis"):
                out[t["name"]] += int(t["hits"])
            if t["name"] == "redis":
                out["redis_bytes"] += int(t["read_bytes"]) + int(t["written_bytes"])
    return out


def workload(seed: int, users: int, turns: int, engines: int) -> list[tuple[int, list[int]]]:
    """(engine index, prompt) in order: 2 shared 512-token system prompts, per-user histories that
    grow 250 tokens a turn (prompts 612-1,112 tokens at 3 turns); a user's turns go round robin over
    the engines (no sticky routing), so its history is found where another engine stored it."""
    systems = [doc(512, seed + i) for i in range(2)]
    histories = [doc(100 + 250 * turns, seed + 10 + u)[1:] for u in range(users)]
    out = []
    for turn in range(turns):
        for u in range(users):
            out.append(((u + turn) % engines, systems[u % 2] + histories[u][: 100 + 250 * turn]))
    return out


def run_fleet(fleet: Fleet, seed: int, users: int, turns: int) -> list[dict]:
    """Each request alone (a 2-core box), classified by where most of its reused prefix came from."""
    rows = []
    for which, prompt in workload(seed, users, turns, len(fleet.engines)):
        engine, server = fleet.engines[which], fleet.servers[which]
        bm = engine.engine.block_manager
        local0, ext0 = bm.prefix_cache_hits, store_metrics(engine)[HITS]
        s0 = server_counts(fleet.servers)
        tier0 = server_counts([server])
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        local, ext = bm.prefix_cache_hits - local0, store_metrics(engine)[HITS] - ext0  # flushes saves
        s1, tier1 = server_counts(fleet.servers), server_counts([server])
        redis_tokens = min(ext, CHUNK * (tier1["redis"] - tier0["redis"]))
        tokens = {"engine": local, "server cpu": ext - redis_tokens, "redis": redis_tokens}
        top = max(tokens, key=tokens.get)
        rows.append({
            "class": top if tokens[top] > 0 else "none", "prompt": len(prompt), **tokens,
            "ttft": out.metrics["time_to_first_token"], "cluster_bytes": s1["redis_bytes"] - s0["redis_bytes"],
        })  # fmt: skip
    return rows


def summarize(rows: list[dict]) -> dict:
    prompt = sum(r["prompt"] for r in rows)
    out = {f"rate {k}": sum(r[k] for r in rows) / prompt for k in CLASSES[:3]}
    out["rate computed"] = 1 - sum(out.values())
    for c in CLASSES:
        t = [r["ttft"] for r in rows if r["class"] == c]
        out[f"n {c}"] = len(t)
        out[f"p50 {c}"] = statistics.median(t) if t else float("nan")
        out[f"p90 {c}"] = pct(t, 0.9) if t else float("nan")
    out["cluster MiB/req"] = sum(r["cluster_bytes"] for r in rows) / len(rows) / 2**20
    return out


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def config_name(engines: int, servers: int) -> str:
    return f"{engines}e x {servers}s"


def ratios(per: dict[str, list[dict]], num: str, num_key: str, den: str, den_key: str) -> list[float]:
    """Per-round ratios num[num_key] / den[den_key] (rounds where both were measured)."""
    out = []
    for x, y in zip(per[den], per[num], strict=True):
        a, b = x[den_key], y[num_key]
        if a == a and b == b and a > 0:
            out.append(b / a)
    return out


def engines_main(args: argparse.Namespace) -> dict:
    configs = [(e, s) for e in args.engine_counts for s in (1, 2)]
    names = [config_name(e, s) for e, s in configs]
    per: dict[str, list[dict]] = {n: [] for n in names}
    with ValkeyCluster(3, replicas=1) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.wait_replicas()
        prefix = f"bench{uuid.uuid4().hex[:6]}:"
        procs = [
            ServerProcess("--tiers", "cpu,redis", "--cpu-capacity", "512MiB", "--redis-url", cluster.urls,
                          "--redis-cluster", "--redis-prefix", prefix, "--state-dir", f"{tmp}/s{i}").start()
            for i in range(2)
        ]  # fmt: skip
        clients = [RemoteBackend(p.url, read_index=False) for p in procs]
        engines = []
        try:
            kw = {
                "max_model_len": 1280,
                "kv_cache_memory": "96MiB",
                "num_threads": 1,
                "kv_backend": "kvstore",
            }
            fleets = []
            for (n_engines, n_servers), name in zip(configs, names, strict=True):
                at = [i % n_servers for i in range(n_engines)]
                made = [LLM("smollm2", kv_store_url=clients[i].url, **kw) for i in at]
                engines += made
                fleets.append(Fleet(name, made, [clients[i] for i in at]))
            for r in range(args.rounds):
                order = fleets if r % 2 == 0 else fleets[::-1]
                for f in order:  # a fresh workload each round and configuration
                    seed = 1000 * (r + 1) + 100 * fleets.index(f) + uuid.uuid4().int % 50
                    per[f.name].append(summarize(run_fleet(f, seed, args.users, args.turns)))
        finally:
            for e in engines:
                e.shutdown()
            for c in clients:
                c.close()
            for p in procs:
                p.stop()
    base = names[0]
    keys = [k for k in per[base][0] if not k.startswith("n ")]
    print(
        f"{args.rounds} rounds x {args.users} users x {args.turns} turns per configuration "
        f"(e: engines, s: servers); medians over rounds (min-max); ratios per round against {base}"
    )
    width = 22
    print(
        " " * 17
        + "".join(f"{n:>{width}}" for n in names)
        + "".join(f"{n + ' / ' + base:>{width}}" for n in names[1:])
    )
    for k in keys:
        cells = [spread([x[k] for x in per[n]]) for n in names]
        cells += [spread(ratios(per, n, k, base, k)) for n in names[1:]]
        print(f"{k:>17}" + "".join(f"{c:>{width}}" for c in cells))
    summary: dict[str, str] = {}
    for e in args.engine_counts:
        one, two = config_name(e, 1), config_name(e, 2)
        comparisons = [  # (label, numerator configuration and class, denominator configuration and class)
            (f"cross-server hit ({two}, redis) / same-server hit ({one}, cpu)", two, "redis", one, "server cpu"),
            (f"cross-server hit / recompute ({two})", two, "redis", two, "none"),
            (f"same-server hit / recompute ({one})", one, "server cpu", one, "none"),
            (f"local hit (engine) / recompute ({two})", two, "engine", two, "none"),
        ]  # fmt: skip
        for label, num, num_class, den, den_class in comparisons:
            for q in ("p50", "p90"):
                line = f"TTFT {q} {label}"
                summary[line] = spread(ratios(per, num, f"{q} {num_class}", den, f"{q} {den_class}"))
                print(f"{line}: {summary[line]}")
    counts = {n: {c: sum(x[f"n {c}"] for x in per[n]) for c in CLASSES} for n in per}
    print("requests per class (all rounds):", counts)
    out = Path.home() / ".cache/kvstore/bench/fleet-engines.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(per, indent=1))
    return {"per_round": per, "ratios": summary, "counts": counts}


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
