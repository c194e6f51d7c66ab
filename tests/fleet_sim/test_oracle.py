"""The oracle (issue 46 item 5): the bound no schedule beats (each request alone on an idle engine,
prefilling only what no earlier request had) and the oracle run (unbounded memory, free transfers),
printed beside every configuration by `kvstore-fleet-sim --oracle`."""

from __future__ import annotations

import json
import math

import pytest
from kvstore.fleet_sim import cli
from kvstore.fleet_sim.oracle import bound_stats, bound_ttfts, free_transfers, oracle_config
from kvstore.fleet_sim.profile import Profile, load_profile
from kvstore.fleet_sim.sim import SimConfig, simulate
from kvstore.fleet_sim.trace import ChunkKeys, TraceRequest, read_trace

from .conftest import profile_doc


def _req(i: int, ids: list[int], n: int) -> TraceRequest:
    return TraceRequest(i, float(i), n, 4, tuple(ids))


def test_the_bound_prefills_only_what_no_earlier_request_had() -> None:
    p = Profile.from_dict(profile_doc(prefill_s_per_token=1e-3, prefill_step_s=0.01, max_batched_tokens=512))
    trace = [_req(0, [1, 2], 1000), _req(1, [1, 2, 3], 1200), _req(2, [9], 100)]
    got = bound_ttfts(trace, p, ChunkKeys(), client_s=0.5)
    # 1000 tokens from scratch: steps of 512 + 488; then 1024 reused (4 chunks: 1000 tokens had them),
    # 176 computed in one step; a new prefix: 100 tokens
    assert got == pytest.approx([1 + 2 * 0.01 + 1.0, 0.176 + 0.01 + 1.0, 0.1 + 0.01 + 1.0])
    # a prompt whose every chunk is known still computes its last engine block (16 tokens)
    assert bound_ttfts([trace[0], trace[0]], p, ChunkKeys())[1] == pytest.approx(0.01 + (1000 - 992) * 1e-3)
    assert bound_stats(trace, p, ChunkKeys())["bound_reuse"] == pytest.approx(1024 / 2300)


@pytest.mark.parametrize("store_gib", [0, math.inf])
def test_no_configuration_beats_the_bound_and_the_oracle_run_reuses_what_it_does(traces, store_gib) -> None:
    trace = read_trace(traces[0], limit=600)
    profile, keys = load_profile("llama3-8b-h100"), ChunkKeys()
    bound = bound_stats(trace, profile, keys)
    for policy in ("round_robin", "ttft"):
        for engines in (2, 16):
            s = simulate(trace, SimConfig(engines, policy, store_gib), profile, keys).stats
            assert s["ttft_p50_s"] >= bound["bound_p50_s"] and s["ttft_p90_s"] >= bound["bound_p90_s"]
            assert s["prefix_reuse"] <= bound["bound_reuse"] + 1e-9
            o = simulate(
                trace, oracle_config(SimConfig(engines, policy, store_gib)), free_transfers(profile), keys
            )
            assert o.stats["ttft_p90_s"] >= bound["bound_p90_s"]
            assert o.stats["load_bytes_per_request"] > 0 or policy == "ttft"
            # nothing evicted, nothing out of reach: a reused block is missed only while an earlier request
            # is still computing it
            assert o.stats["miss_evicted"] == o.stats["miss_elsewhere"] == 0
            assert o.stats["prefix_reuse"] <= bound["bound_reuse"] + 1e-9
            # free transfers: a request's store load takes no time
            assert all(j.load_s == 0 for j in o.jobs)


def test_the_cli_prints_the_oracle_beside_every_configuration(traces, capsys) -> None:
    argv = ["--trace", str(traces[0]), "--limit", "300", "--engines", "2,8", "--policy", "round_robin,ttft",
            "--store-gib", "0,inf", "--oracle", "--json", "--no-plot"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 8 and len({r["bound_p90_s"] for r in rows}) == 1
    for r in rows:
        assert (
            r["p90_vs_bound"] == pytest.approx(r["ttft_p90_s"] / r["bound_p90_s"]) and r["p90_vs_bound"] >= 1
        )
        assert r["oracle_p90_s"] >= r["bound_p90_s"]
    assert cli.main([a for a in argv if a != "--json"]) == 0
    out = capsys.readouterr().out
    assert "bound p90 s" in out and "x bound" in out and "oracle p90 s" in out
