"""validate.py: bench_router.py's figures read from the JSON it writes, the replay simulated on the same
slice, the residuals judged against the issue's tolerances (±2 points of hit rate, ±15% of TTFT p50,
same orders)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from kvstore.engine.router.scoring import Costs
from kvstore.fleet_sim import conversations, validate

from benchmarks import bench_router

# one bench_router.py run as its --json writes it (a figure it has not measured is absent)
RUN = {
    "policies": {
        "round_robin": {"local": 0.05, "store": 0.40, "p50": 0.4, "p90": 0.9, "rps": 1.4, "imbalance": 1.1},
        "ttft": {"local": 0.2, "store": 0.3, "p50": 0.3, "p90": 0.7, "rps": 1.45, "imbalance": 1.3},
    },
    "costs": {"prefill_s_per_token": 0.001, "load_s_per_token": 0.0001, "step_s_per_request": 0.01},
}


def test_real_figures() -> None:
    real = validate.real_figures(RUN)
    assert real["round_robin"] == {
        "local": 0.05,
        "store": 0.40,
        "p50": 0.4,
        "p90": 0.9,
        "rps": 1.4,
        "imbalance": 1.1,
    }
    assert real["ttft"]["local"] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        validate.real_figures({"policies": {}})
    with pytest.raises(ValueError):
        validate.read_runs({"runs": []})


def test_what_bench_router_writes_is_what_validate_reads(tmp_path) -> None:
    """The exchange: bench_router.py's figures() of a run, through its --json document, are the real
    side validate.py compares."""
    results = {pol: {"records": [("a", 0.2), ("b", 0.4), ("a", 0.3)], "wall": 2.0, "per_engine": {},
                     "prompt": 1000.0, "local": 100.0, "store": 300.0, "firsts": 3.0, "ttft_s": 0.75,
                     "prefill_s": 0.3, "engine_cpu_s": 4.0} for pol in ("round_robin", "ttft")}  # fmt: skip
    results["ttft"]["firsts"] = 0.0  # its engines counted no first token: no phases
    fleets = {pol: ("router", ["a", "b"]) for pol in results}
    figures = bench_router.figures(list(results), results, fleets)
    doc = json.loads(
        json.dumps({"runs": [{"policies": figures, "beside_cores": 0.5, "costs": RUN["costs"]}]})
    )
    real, p50s = validate.read_runs(doc)
    assert real["round_robin"] == pytest.approx({"local": 0.1, "store": 0.3, "p50": 0.3, "p90": 0.4, "rps": 1.5,
                                                 "imbalance": 4 / 3, "before": 0.15, "prefill": 0.1,
                                                 "outside": 0.05, "cpu": 4.0})  # fmt: skip
    assert "before" not in real["ttft"] and p50s == {"round_robin": [0.3], "ttft": [0.3]}
    assert validate.engine_cores(doc, 2.0) == 1.5
    help_text = subprocess.run([sys.executable, str(validate.BENCH_ROUTER), "--help"], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
    assert "--json PATH" in help_text


def test_where_the_ttft_goes_is_read_and_shown_beside_the_simulated() -> None:
    phased = {**RUN["policies"]["round_robin"], "before": 0.25, "prefill": 0.3, "outside": 0.02}
    real = validate.real_figures({"policies": {**RUN["policies"], "round_robin": phased}})
    assert (real["round_robin"]["before"], real["round_robin"]["prefill"], real["round_robin"]["outside"]) == (
        0.25, 0.3, 0.02)  # fmt: skip
    assert "before" not in real["ttft"]
    sim = {p: {"local": 0.1, "store": 0.4, "p50": 0.4, "p90": 0.9, "imbalance": 1.0, "before": 0.125,
               "prefill": 0.5, "outside": 0.0} for p in real}  # fmt: skip
    table, _ = validate.compare(real, sim)
    assert "  0.250s  0.125s |   0.300s  0.500s |   0.020s" in table


def test_compare_judges_the_residuals() -> None:
    real = validate.real_figures(RUN)
    close = {"round_robin": {"local": 0.06, "store": 0.40, "p50": 0.44, "p90": 1.0, "imbalance": 1.0},
             "ttft": {"local": 0.19, "store": 0.30, "p50": 0.29, "p90": 0.8, "imbalance": 1.25}}  # fmt: skip
    table, ok = validate.compare(real, close)
    assert ok and "+1.0p" in table and "same" in table
    assert "1.30  1.25" in table  # imbalance, real and simulated: shown, not judged
    far = {**close, "ttft": {**close["ttft"], "p50": 0.5}}  # +67%, and now slower than round_robin
    table, ok = validate.compare(real, far)
    assert not ok and "DIFFERENT" in table


def test_the_replay_simulates_every_policy(tmp_path) -> None:
    args = argparse.Namespace(profile="llama3-8b-h100", window=1500, conversations=3, rounds=2, rps=1.5, slice="spread",
                              no_store_baseline=True,
                              block_tokens=32, max_blocks=24, kv_cache_memory="64MiB", cpu_cores=2.0,
                              policies=["round_robin", "ttft"], replays=3, jitter_s=0.02, client_s=0.005)  # fmt: skip
    sim, p50s, costs = validate.run_sims(args)
    assert costs.step_s_per_request != Costs().step_s_per_request  # calibrated from the simulated engines
    assert set(sim) == set(p50s) == {"round_robin", "ttft", "round_robin/no-store"}
    for pol, r in sim.items():
        assert 0 < r["local"] + r["store"] < 1 and 0 < r["p50"] <= r["p90"] and r["imbalance"] >= 1
        assert r["before"] >= 0 and 0 < r["prefill"] < r["p90"]
        assert len(p50s[pol]) == 3 and r["p50"] == sorted(p50s[pol])[1]  # the median replay's
    # the replays differ only by when each request is sent: jittered, their TTFTs move; without, never
    assert any(len(set(v)) > 1 for v in p50s.values())
    still = validate.run_sims(argparse.Namespace(**{**vars(args), "jitter_s": 0.0}))[1]
    assert all(len(set(v)) == 1 for v in still.values())


def test_rounds_spread_their_conversations_over_the_window() -> None:
    convs = conversations.conversations(conversations.TRACE, 1500)
    plan = conversations.rounds(convs, 12, 2)
    firsts = [[c[0]["timestamp"] for c in chunk] for chunk in plan]
    assert len(plan) == 2 and all(len(chunk) == 12 for chunk in plan)
    assert len({id(c) for chunk in plan for c in chunk}) == 24  # no conversation twice
    span = convs[-1][0]["timestamp"] - convs[0][0]["timestamp"]
    for f in firsts:  # each round's first turns reach over most of the window, not its first seconds
        assert f == sorted(f) and f[-1] - f[0] > 0.6 * span
    burst = conversations.rounds(convs, 12, 2, "first")
    assert (
        burst[1][0] is convs[12] and burst[0][-1][0]["timestamp"] - burst[0][0][0]["timestamp"] < 0.01 * span
    )
    with pytest.raises(SystemExit, match="conversations"):
        conversations.rounds(convs, 200, 2)


def test_orders_count_only_where_the_real_run_orders_the_policies() -> None:
    real = {"a": {"local": 0.30, "store": 0.20, "p50": 0.40, "p90": 1.0, "imbalance": 1.0},
            "b": {"local": 0.31, "store": 0.20, "p50": 0.41, "p90": 1.0, "imbalance": 1.0},  # a tie with a
            "c": {"local": 0.10, "store": 0.0, "p50": 0.80, "p90": 2.0, "imbalance": 1.0}}  # fmt: skip
    swapped = {**real, "a": real["b"], "b": real["a"]}  # a and b in the other order: still fine
    table, ok = validate.compare(real, swapped)
    assert ok and table.count("2 pairs apart") == 2, table
    table, ok = validate.compare(real, {**real, "c": {**real["c"], "p50": 0.35}})  # c fastest: wrong
    assert not ok and "DIFFERENT: c before a, c before b" in table


def test_the_simulated_engines_get_the_cores_the_real_ones_had() -> None:
    assert validate.engine_cores({"runs": [{**RUN, "beside_cores": 0.49}]}, 2.0) == pytest.approx(1.51)
    assert validate.engine_cores({"runs": [RUN]}, 2.0) == 2.0
    assert (
        validate.engine_cores({"runs": [{**RUN, "beside_cores": 1.9}]}, 2.0) == 0.5
    )  # never below half a core


def test_sim_only_prints_the_simulated_table(capsys) -> None:
    argv = ["--sim-only", "--conversations", "3", "--rounds", "2", "--policies", "round_robin,ttft",
            "--profile", "llama3-8b-h100", "--cpu-cores", "0"]  # fmt: skip
    assert validate.main(argv) == 0
    out = capsys.readouterr().out
    assert "each engine its own CPU" in out and "ttft's TTFT p90:" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("round_robin", "ttft "))]
    assert [r[0] for r in rows] == ["round_robin", "ttft", "round_robin/no-store"]


def _run(beside: float, rr: dict | None = None, ttft: dict | None = None) -> dict:
    pols = RUN["policies"]
    return {"policies": {"round_robin": {**pols["round_robin"], **(rr or {})}, "ttft": {**pols["ttft"], **(ttft or {})}},
            "beside_cores": beside, "costs": RUN["costs"]}  # fmt: skip


def test_several_real_runs_give_the_median_of_each_figure() -> None:
    runs = [_run(0.1), _run(0.3, {"p50": 0.5}, {"local": 0.22, "store": 0.28}), _run(0.2, {"p50": 0.46})]
    doc = {"runs": runs}
    real, p50s = validate.read_runs(doc)
    assert p50s == {"round_robin": [0.4, 0.5, 0.46], "ttft": [0.3, 0.3, 0.3]}
    assert real["round_robin"]["p50"] == 0.46 and real["ttft"]["local"] == pytest.approx(0.2)
    # what the runs left the engines, on average
    assert validate.engine_cores(doc, 2.0) == pytest.approx(1.8)
    # one run alone is its own median
    assert validate.read_runs({"runs": runs[:1]})[0] == validate.real_figures(runs[0])
    # a policy some run lacks is left out, not half-counted
    lacking = {"policies": {"round_robin": RUN["policies"]["round_robin"]}}
    assert set(validate.read_runs({"runs": [runs[0], lacking]})[0]) == {"round_robin"}


def test_a_saved_real_run_is_read_back(tmp_path, capsys) -> None:
    """--real reads what --save wrote (bench_router.py's JSON, its runs), and compares the simulation."""
    saved = tmp_path / "real.json"
    saved.write_text(json.dumps({"benchmark": "bench_router", "runs": [_run(0.2)]}))
    argv = ["--real", str(saved), "--conversations", "3", "--rounds", "2", "--policies", "round_robin,ttft",
            "--no-store-baseline", "0", "--profile", "llama3-8b-h100", "--replays", "1", "--as-profiled"]  # fmt: skip
    assert validate.main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert "real: the median of 1 runs" in out and "prefill_s_per_token 0.001 / " in out
