"""validate.py: bench_router.py's table parsed, the replay simulated on the same slice, the residuals
judged against the issue's tolerances (±2 points of hit rate, ±15% of TTFT p50, same orders)."""

from __future__ import annotations

import argparse

import pytest
from kvstore.engine.router.scoring import Costs
from kvstore.fleet_sim import validate

from benchmarks import bench_router

REAL = """
Mooncake conversation trace, 2 rounds x 12 conversations (...)

      policy local hit store hit recompute  TTFT p50  TTFT p90  req/s imbalance
 round_robin      5.0%     40.0%     55.0%    0.400s    0.900s   1.40      1.10
        ttft     20.0%     30.0%     50.0%    0.300s    0.700s   1.45      1.30
"""


def test_parse_real() -> None:
    real = validate.parse_real(REAL)
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
        validate.parse_real("no table here")


def test_where_the_ttft_goes_is_parsed_and_shown_beside_the_simulated() -> None:
    text = (
        REAL
        + """
where a request's TTFT goes, mean seconds (the engines' histograms): before its first prefill step (...)
         round_robin before prefill 0.250s  prefill 0.300s  outside 0.020s
"""
    )
    real = validate.parse_real(text)
    assert (real["round_robin"]["before"], real["round_robin"]["prefill"], real["round_robin"]["outside"]) == (
        0.25, 0.3, 0.02)  # fmt: skip
    assert "before" not in real["ttft"]
    sim = {p: {"local": 0.1, "store": 0.4, "p50": 0.4, "p90": 0.9, "imbalance": 1.0, "before": 0.125,
               "prefill": 0.5, "outside": 0.0} for p in real}  # fmt: skip
    table, _ = validate.compare(real, sim)
    assert "  0.250s  0.125s |   0.300s  0.500s |   0.020s" in table
    assert validate.parse_real(REAL)["round_robin"].keys() == {
        "local",
        "store",
        "p50",
        "p90",
        "rps",
        "imbalance",
    }


def test_compare_judges_the_residuals() -> None:
    real = validate.parse_real(REAL)
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
    convs = bench_router.conversations(bench_router.TRACE, 1500)
    plan = bench_router.rounds(convs, 12, 2)
    firsts = [[c[0]["timestamp"] for c in chunk] for chunk in plan]
    assert len(plan) == 2 and all(len(chunk) == 12 for chunk in plan)
    assert len({id(c) for chunk in plan for c in chunk}) == 24  # no conversation twice
    span = convs[-1][0]["timestamp"] - convs[0][0]["timestamp"]
    for f in firsts:  # each round's first turns reach over most of the window, not its first seconds
        assert f == sorted(f) and f[-1] - f[0] > 0.6 * span
    burst = bench_router.rounds(convs, 12, 2, "first")
    assert (
        burst[1][0] is convs[12] and burst[0][-1][0]["timestamp"] - burst[0][0][0]["timestamp"] < 0.01 * span
    )
    with pytest.raises(SystemExit, match="conversations"):
        bench_router.rounds(convs, 200, 2)


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
    line = ("CPU beside the engines in 150.0 s of rounds: the routers, kvstore-server and this client 0.09 "
            "cores, the rest of the box 0.40; in all 0.49 cores")  # fmt: skip
    assert validate.engine_cores(REAL + line + "\n", 2.0) == pytest.approx(1.51)
    assert validate.engine_cores(REAL, 2.0) == 2.0
    assert (
        validate.engine_cores(line.replace("0.49 cores", "1.90 cores"), 2.0) == 0.5
    )  # never below half a core


def test_sim_only_prints_the_simulated_table(capsys) -> None:
    argv = ["--sim-only", "--conversations", "3", "--rounds", "2", "--policies", "round_robin,ttft",
            "--profile", "llama3-8b-h100", "--cpu-cores", "0"]  # fmt: skip
    assert validate.main(argv) == 0
    out = capsys.readouterr().out
    assert "each engine its own CPU" in out and "ttft's TTFT p90:" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("round_robin", "ttft "))]
    assert [r[0] for r in rows] == ["round_robin", "ttft", "round_robin/no-store"]


def test_several_real_runs_give_the_median_of_each_figure() -> None:
    line = ("CPU beside the engines in 150.0 s of rounds: the routers, kvstore-server and this client 0.09 "
            "cores, the rest of the box 0.01; in all {} cores")  # fmt: skip
    runs = [
        REAL + line.format("0.10"),
        REAL.replace("0.400s", "0.500s").replace("20.0%     30.0%", "22.0%     28.0%") + line.format("0.30"),
        REAL.replace("0.400s", "0.460s") + line.format("0.20"),
    ]
    text = validate.RUN_SEP.join(runs)
    real, p50s = validate.parse_runs(text)
    assert p50s == {"round_robin": [0.4, 0.5, 0.46], "ttft": [0.3, 0.3, 0.3]}
    assert real["round_robin"]["p50"] == 0.46 and real["ttft"]["local"] == pytest.approx(0.2)
    # what the runs left the engines, on average
    assert validate.engine_cores(text, 2.0) == pytest.approx(1.8)
    # one run alone is its own median
    assert validate.parse_runs(runs[0])[0] == validate.parse_real(runs[0])
    # a policy some run lacks is left out, not half-counted
    assert set(validate.parse_runs(runs[0] + validate.RUN_SEP + REAL.split(" ttft")[0])[0]) == {"round_robin"}
