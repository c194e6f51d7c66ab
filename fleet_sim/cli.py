"""`kvstore-fleet-sim` (or `python -m kvstore.fleet_sim` from the repository root).

    kvstore-fleet-sim --trace conversation --engines 1,4,16,64,256 --policy round_robin,ttft \\
        --store-gib 0,64,inf --profile llama3-8b-h100

One simulation per (engines, policy, store GiB, engine KV GiB); prints a table (or, with --json, one
JSON object a line) and writes a plot. `inf` is unbounded; a store of 0 GiB is no store.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from kvstore.engine.router.scoring import POLICIES
from kvstore.fleet_sim import oracle, report
from kvstore.fleet_sim.profile import load_profile
from kvstore.fleet_sim.sim import SimConfig, simulate
from kvstore.fleet_sim.trace import TRACES, ChunkKeys, read_trace

from kvstore.errors import InvalidArgument

# generated, out of the repository (KVSTORE_CACHE_DIR as kvstore's other caches)
PLOT = (
    Path(os.environ.get("KVSTORE_CACHE_DIR") or Path.home() / ".cache" / "kvstore")
    / "bench"
    / "fleet_sim.html"
)


def trace_path(name: str) -> Path:
    """A path, or `conversation` / `synthetic` for the Mooncake traces in ../shared/traces."""
    p = Path(name)
    if p.exists() or p.suffix:
        return p
    return TRACES / f"mooncake_{name}_trace.jsonl"


def _numbers(text: str, what: str, integer: bool = False) -> list[float]:
    out: list[float] = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            v = math.inf if part in ("inf", "infinity", "unbounded") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {part!r} is not a number or inf") from None
        if v < 0 or (integer and (math.isinf(v) or v != int(v) or v < 1)):
            raise argparse.ArgumentTypeError(f"{what}: {part!r} is out of range")
        out.append(int(v) if integer else v)
    return out


def _policies(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad)}; choose from {', '.join(POLICIES)}"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-fleet-sim", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace", default="conversation", help="a Mooncake JSONL trace, or conversation / synthetic"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--engines", type=lambda t: _numbers(t, "--engines", integer=True), default=[1, 4, 16, 64])
    p.add_argument("--policy", type=_policies, default=["ttft"], help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--store-gib", type=lambda t: _numbers(t, "--store-gib"), default=[math.inf],
                   help="the shared Valkey Cluster tier, comma list; 0 = no store, inf = unbounded")  # fmt: skip
    p.add_argument("--engine-kv-gib", type=lambda t: _numbers(t, "--engine-kv-gib"), default=[None],
                   help="each engine's local KV (default: the profile's); inf = unbounded")  # fmt: skip
    p.add_argument("--server-gib", type=lambda t: _numbers(t, "--server-gib")[0], default=None,
                   help="each kvstore-server's own memory tier (default: the profile's)")  # fmt: skip
    p.add_argument("--engines-per-server", type=int, default=None, help="default: the profile's")
    p.add_argument("--profile", default="llama3-8b-h100", help="a name under fleet_sim/profiles or a path")
    p.add_argument("--oracle", action="store_true",
                   help="beside every configuration: the same engines and policy with unbounded memory and free "
                        "transfers (oracle p50/p90), and the bound no schedule beats (each request alone on an "
                        "idle engine prefilling only what no earlier request had: bound p90, p90 / bound)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object a line per configuration")
    p.add_argument("--plot", type=Path, default=PLOT, help=f"PNG (matplotlib) or HTML (default {PLOT})")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        trace = read_trace(trace_path(args.trace), args.limit)
    except (InvalidArgument, OSError) as e:
        print(f"kvstore-fleet-sim: {e}", file=sys.stderr)
        return 2
    keys = ChunkKeys()
    rows = []
    bound = oracle.bound_stats(trace, profile, keys) if args.oracle else {}
    for engines in args.engines:
        for policy in args.policy:
            best = {}
            if args.oracle:
                config = oracle.oracle_config(SimConfig(engines, policy, math.inf, math.inf, args.server_gib,
                                                        args.engines_per_server))  # fmt: skip
                o = simulate(trace, config, oracle.free_transfers(profile), keys).stats
                best = {"oracle_p50_s": o["ttft_p50_s"], "oracle_p90_s": o["ttft_p90_s"],
                        "oracle_reuse": o["prefix_reuse"]}  # fmt: skip
            for store_gib in args.store_gib:
                for kv_gib in args.engine_kv_gib:
                    config = SimConfig(
                        engines, policy, store_gib, kv_gib, args.server_gib, args.engines_per_server
                    )
                    row = simulate(trace, config, profile, keys).row()
                    if row["engine_kv_gib"] is None:
                        row["engine_kv_gib"] = profile.engine_kv_gib
                    if args.oracle:
                        row.update(best, **bound)
                        row["p90_vs_oracle"] = row["ttft_p90_s"] / best["oracle_p90_s"]
                        row["p90_vs_bound"] = row["ttft_p90_s"] / bound["bound_p90_s"]
                    rows.append(row)
                    if args.json:
                        print(report.json_line(row), flush=True)
                    else:
                        print(f"  {engines} engines, {policy}, store {store_gib:g} GiB: {row['wall_s']:.1f} s",
                              file=sys.stderr, flush=True)  # fmt: skip
    if not args.json:
        print(f"{trace_path(args.trace).name}: {len(trace)} requests, profile {profile.name}")
        print(report.table(rows))
        if args.oracle:
            print(f"oracle: the same engines and policy with unbounded memory and free transfers; bound: each "
                  f"request alone on an idle engine, prefilling only what no earlier request had (TTFT p50 "
                  f"{bound['bound_p50_s']:.3f} s, p90 {bound['bound_p90_s']:.3f} s, prefix reuse "
                  f"{bound['bound_reuse']:.1%}); x bound = TTFT p90 / the bound's")  # fmt: skip
        for engines, policy, gib, unbounded in report.capacity_for(rows):
            where = "not reached by the swept capacities" if math.isnan(gib) else f"~{gib:.0f} GiB"
            print(f"90% of the unbounded hit rate ({unbounded:.1%}) at {engines} engines, {policy}: {where}")
    if not args.no_plot:
        title = f"{trace_path(args.trace).name}, profile {profile.name}"
        path = report.write_plot(rows, args.plot, title)
        print(f"plot: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from kvstore.provenance import recorded

    recorded(main, "fleet_sim")
