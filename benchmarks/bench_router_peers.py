"""kvstore's router against its peers: one Mooncake trace through Dynamo's mocker engines behind Dynamo's
`kv_router` and `round_robin`, and through `kvstore-fleet-sim` behind kvstore's policies, with the engines
and their KV capacity matched, at several fleet sizes.

    .venv/bin/python benchmarks/bench_router_peers.py --trace conversation --engines 8,32,128

Dynamo's side is `dynamo._core.run_mocker_trace_replay(trace_format="mooncake", router_mode=...)` from
ai-dynamo-runtime (1.6.1), run in an interpreter of its own (`--dynamo-python`; by default this one if it
imports `dynamo`, else `$KVSTORE_DYNAMO_PYTHON`, else `~/.cache/kvstore/dynamo-venv/bin/python`): it pins
pydantic below the project's. Make one with
`python -m venv ~/.cache/kvstore/dynamo-venv && ~/.cache/kvstore/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1`.

Matched: every Dynamo mocker engine gets the simulated engine's KV capacity in tokens (the profile's
`engine_kv_gib` over its KV bytes per token: 409,600 tokens for `llama3-8b-h100`) as `num_gpu_blocks` x
`block_size`, and the profile's `max_num_seqs` and `max_num_batched_tokens`; prefix caching and chunked
prefill on both; 512-token trace blocks on both; no store on either side (`--store-gib` adds kvstore rows
with one). Round robin on both sides is the check that the engines match: its prefix reuse depends only on
the engines' caches, and the two agree to a fraction of a point.

Both sides are measured the same way, from per-request records: prefix reuse = prompt tokens not prefilled
(Dynamo: `reused_input_tokens`; kvstore: tokens from the engine's cache or the store) / prompt tokens;
imbalance = the busiest engine's requests / the mean; TTFT p50 / p90. Absolute TTFTs are not comparable
across the two: Dynamo's mocker has its own timing model (a polynomial fit of vLLM on a GPU) and kvstore's
simulator the profile's costs; what compares is each side's order of its routers by TTFT and each router's
TTFT over its own side's round robin.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
DYNAMO_VENV_PYTHON = Path.home() / ".cache" / "kvstore" / "dynamo-venv" / "bin" / "python"
TRACE_BLOCK = 512
DYNAMO_ROUTERS = ("round_robin", "kv_router")


# ---- Dynamo's side (runs under the interpreter that has ai-dynamo-runtime: standard library only) --------
def dynamo_worker(spec: dict) -> None:
    """Replays spec["trace"] through Dynamo's mocker for each router mode and engine count; prints one JSON
    object a line: {engines, router, wall_s, records: [[prompt tokens, reused tokens, worker, ttft ms]]}."""
    os.environ.setdefault("DYN_LOG", "error")
    os.environ.setdefault("RUST_LOG", "error")
    from dynamo._core import run_mocker_trace_replay

    for engines in spec["engines"]:
        for mode in spec["routers"]:
            started = time.perf_counter()
            result = run_mocker_trace_replay(
                [spec["trace"]],
                extra_engine_args={"engine": spec["engine"]},
                num_workers=engines,
                router_mode=mode,
                trace_block_size=TRACE_BLOCK,
                trace_format="mooncake",
                capture_per_request=True,
            )
            records = []
            for r in result.per_request:
                worker = r.get("decode_worker_idx")
                if worker is None and r.get("routing_history"):
                    worker = r["routing_history"][-1].get("logical_worker_id")
                records.append([r["input_length"], r["reused_input_tokens"], worker, r["ttft_ms"]])
            out = {
                "engines": engines,
                "router": mode,
                "wall_s": time.perf_counter() - started,
                "records": records,
            }
            print(json.dumps(out), flush=True)


def dynamo_python(given: str | None) -> str:
    if given:
        return given
    try:
        import dynamo._core  # noqa: F401

        return sys.executable
    except ImportError:
        pass
    return os.environ.get("KVSTORE_DYNAMO_PYTHON") or str(DYNAMO_VENV_PYTHON)


def run_dynamo(
    python: str, trace: Path, engines: list[int], engine_args: dict, repeat: int
) -> dict[tuple[int, str], list[dict]]:
    """(engines, router mode) -> one result per replay (Dynamo's replays differ from run to run)."""
    spec = {"trace": str(trace), "engines": engines, "routers": list(DYNAMO_ROUTERS), "engine": engine_args}
    out: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for _ in range(repeat):
        proc = subprocess.run(
            [python, __file__, "--dynamo-worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if proc.returncode != 0:
            raise SystemExit(f"Dynamo's side failed ({python}):\n{proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[row["engines"], row["router"]].append(row)
    return out


# ---- the comparison -------------------------------------------------------------------------------------
def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def figures(records: list[tuple[int, int, object, float]], engines: int) -> dict[str, float]:
    """(prompt tokens, tokens not prefilled, engine, TTFT s) per request -> reuse, imbalance, p50, p90."""
    per_engine = collections.Counter(r[2] for r in records)
    ttfts = [r[3] for r in records]
    return {
        "reuse": sum(r[1] for r in records) / sum(r[0] for r in records),
        "imbalance": max(per_engine.values()) * engines / len(records),
        "engines_used": len(per_engine),
        "p50": quantile(ttfts, 0.5),
        "p90": quantile(ttfts, 0.9),
        "requests": len(records),
    }


def order(rows: dict[str, dict], key: str) -> str:
    return " < ".join(name for name, _ in sorted(rows.items(), key=lambda kv: kv[1][key]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace", default="conversation", help="a Mooncake JSONL trace, or conversation / synthetic"
    )
    p.add_argument("--skip", type=int, default=0, help="start at the trace's request N (a slice of it)")
    p.add_argument("--limit", type=int, default=None, help="only N requests")
    p.add_argument("--engines", default="8,32,128", help="comma list of fleet sizes")
    p.add_argument(
        "--policies", default="round_robin,ttft", help="kvstore's side (kvstore-fleet-sim policies)"
    )
    p.add_argument("--store-gib", default="0", help="kvstore's side, comma list: 0 = no store (as Dynamo's)")
    p.add_argument("--profile", default="llama3-8b-h100", help="the simulator's cost profile")
    p.add_argument("--block-size", type=int, default=64, help="Dynamo's mocker block size (its default, 64)")
    p.add_argument("--dynamo-python", default=None, help="an interpreter with ai-dynamo-runtime installed")
    p.add_argument("--repeat", type=int, default=3,
                   help="Dynamo's replays per configuration (they differ from run to run; kvstore's simulator "
                        "gives the same result every time)")  # fmt: skip
    p.add_argument("--dynamo-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dynamo_worker:
        dynamo_worker(json.loads(args.dynamo_worker))
        return {}

    sys.path.insert(0, str(ROOT))
    from kvstore.fleet_sim.cli import trace_path
    from kvstore.fleet_sim.profile import load_profile
    from kvstore.fleet_sim.sim import SimConfig, simulate
    from kvstore.fleet_sim.trace import CHUNK, ChunkKeys, read_trace

    engines = [int(x) for x in args.engines.split(",")]
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    stores = [math.inf if x.strip() == "inf" else float(x) for x in args.store_gib.split(",")]
    profile = load_profile(args.profile)
    chunk_bytes = profile.chunk_bytes(CHUNK)
    kv_tokens = math.floor(profile.engine_kv_gib * 2**30 / chunk_bytes) * CHUNK
    engine_args = {
        "block_size": args.block_size,
        "num_gpu_blocks": kv_tokens // args.block_size,
        "max_num_seqs": profile.max_num_seqs,
        "max_num_batched_tokens": profile.max_batched_tokens,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    source = trace_path(args.trace)
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-peers-"))
    try:
        sliced = tmp / source.name  # both sides read the very same lines
        with source.open() as f, sliced.open("w") as out:
            kept = 0
            for i, line in enumerate(f):
                if not line.strip() or i < args.skip:
                    continue
                if args.limit is not None and kept >= args.limit:
                    break
                out.write(line)
                kept += 1
        trace = read_trace(sliced)
        python = dynamo_python(args.dynamo_python)
        if not shutil.which(python) and not Path(python).exists():
            raise SystemExit(f"no interpreter with ai-dynamo-runtime at {python}: see --help")
        print(f"{source.name} requests {args.skip}-{args.skip + len(trace) - 1} ({len(trace)}); engines of "
              f"{kv_tokens:,} tokens of KV each (kvstore: profile {profile.name}, {profile.engine_kv_gib:g} GiB; "
              f"Dynamo's mocker: {engine_args['num_gpu_blocks']} blocks of {args.block_size}), max_num_seqs "
              f"{profile.max_num_seqs}, max_num_batched_tokens {profile.max_batched_tokens}", flush=True)  # fmt: skip
        started = time.perf_counter()
        dyn = run_dynamo(python, sliced, engines, engine_args, args.repeat)
        print(f"Dynamo's side: {time.perf_counter() - started:.0f} s ({python})", file=sys.stderr, flush=True)
        keys = ChunkKeys()
        results: dict = {"trace": source.name, "requests": len(trace), "kv_tokens": kv_tokens, "sizes": {}}
        for n in engines:
            rows: dict[str, dict] = {}
            runs: dict[str, list[dict]] = {}
            for mode in DYNAMO_ROUTERS:
                runs[mode] = [
                    figures([(a, b, w, t / 1000) for a, b, w, t in run["records"]], n) for run in dyn[n, mode]
                ]
                # the median replay of each figure; its spread in the row's "range"
                rows[f"dynamo {mode}"] = {
                    k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]
                }
            for store in stores:
                for policy in policies:
                    t0 = time.perf_counter()
                    jobs = simulate(trace, SimConfig(n, policy, store), profile, keys).jobs
                    recs = [
                        (j.req.input_tokens, j.local_tokens + j.store_tokens, j.engine, j.ttft_s)
                        for j in jobs
                    ]
                    name = f"kvstore {policy}" + ("" if store == 0 else f" +store {store:g} GiB")
                    rows[name] = figures(recs, n)
                    print(f"  {n} engines, kvstore {policy}, store {store:g}: {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)  # fmt: skip
            for name, r in rows.items():
                if name.startswith("kvstore") and "kvstore round_robin" in rows:
                    r["p50_vs_rr"] = r["p50"] / rows["kvstore round_robin"]["p50"]
                    r["p90_vs_rr"] = r["p90"] / rows["kvstore round_robin"]["p90"]
            # Dynamo's ratios replay by replay (the i-th kv_router replay over the i-th round robin one)
            for mode in DYNAMO_ROUTERS:
                for q in ("p50", "p90"):
                    ratios = [a[q] / b[q] for a, b in zip(runs[mode], runs["round_robin"], strict=True)]
                    rows[f"dynamo {mode}"][f"{q}_vs_rr"] = statistics.median(ratios)
                    rows[f"dynamo {mode}"][f"{q}_vs_rr_range"] = (min(ratios), max(ratios))
                rows[f"dynamo {mode}"]["reuse_range"] = (
                    min(r["reuse"] for r in runs[mode]),
                    max(r["reuse"] for r in runs[mode]),
                )
            results["sizes"][n] = rows
            print(f"\n{n} engines")
            print(f"  {'router':<34} {'prefix reuse':>12} {'imbalance':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
                  f"{'p50/rr':>7} {'p90/rr':>7}")  # fmt: skip
            for name, r in rows.items():
                print(f"  {name + (f' (median of {args.repeat})' if name.startswith('dynamo') and args.repeat > 1 else ''):<34} {r['reuse']:>12.1%} {r['imbalance']:>9.2f} {r['p50']:>8.3f}s {r['p90']:>8.3f}s "
                      f"{r.get('p50_vs_rr', math.nan):>7.2f} {r.get('p90_vs_rr', math.nan):>7.2f}")  # fmt: skip
            for key in ("p50", "p90"):
                d = {k.split(" ", 1)[1]: v for k, v in rows.items() if k.startswith("dynamo")}
                k = {k.split(" ", 1)[1]: v for k, v in rows.items() if k.startswith("kvstore")}
                print(f"  by TTFT {key}, fastest first: Dynamo {order(d, key)}; kvstore {order(k, key)}")
            if args.repeat > 1:
                for mode in DYNAMO_ROUTERS:
                    r = rows[f"dynamo {mode}"]
                    lo, hi = r["reuse_range"]
                    print(f"  dynamo {mode} over {args.repeat} replays: prefix reuse {lo:.1%}-{hi:.1%}, p50/rr "
                          f"{r['p50_vs_rr_range'][0]:.2f}-{r['p50_vs_rr_range'][1]:.2f}, p90/rr "
                          f"{r['p90_vs_rr_range'][0]:.2f}-{r['p90_vs_rr_range'][1]:.2f}")  # fmt: skip
            if "kvstore round_robin" in rows:
                a, b = rows["kvstore round_robin"]["reuse"], rows["dynamo round_robin"]["reuse"]
                print(f"  round robin's prefix reuse: kvstore {a:.2%}, Dynamo {b:.2%} ({abs(a - b) * 100:.2f} points "
                      f"apart: the engines' caches match)")  # fmt: skip
            if "kvstore ttft" in rows:  # against kv_router's best replay
                t, kv = rows["kvstore ttft"], rows["dynamo kv_router"]
                best_reuse, best_p90 = kv["reuse_range"][1], kv["p90_vs_rr_range"][0]
                ok_reuse, ok_p90 = t["reuse"] >= best_reuse, t["p90_vs_rr"] <= best_p90
                print(f"  ttft's prefix reuse {t['reuse']:.1%} vs kv_router's best replay's {best_reuse:.1%}: "
                      f"{'at least' if ok_reuse else 'BELOW'}; ttft's TTFT p90 / its round robin's "
                      f"{t['p90_vs_rr']:.2f} vs kv_router's best {best_p90:.2f}: "
                      f"{'no worse' if ok_p90 else 'WORSE'}")  # fmt: skip
        print("\nAbsolute TTFTs are not comparable across the sides: Dynamo's mocker has its own timing model, "
              "kvstore's simulator the profile's costs; compare each side's order and its ratios to its own "
              "round robin (p50/rr, p90/rr).")  # fmt: skip
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if "--dynamo-worker" in sys.argv:  # under Dynamo's interpreter: no kvstore, no provenance record
        main()
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from provenance import recorded  # benchmarks/ is sys.path[0]

        recorded(main)
