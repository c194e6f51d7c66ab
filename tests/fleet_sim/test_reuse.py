"""With unbounded memory the simulator reproduces the traces README's prefix-block reuse exactly:
36.6% of the conversation trace's 288,500 block references (182,790 distinct) and 64.0% of the
synthetic trace's 121,877 (43,924 distinct)."""

from __future__ import annotations

import math

import pytest
from kvstore.fleet_sim.profile import load_profile
from kvstore.fleet_sim.sim import SimConfig, simulate
from kvstore.fleet_sim.trace import read_trace

EXPECTED = {0: (288500, 182790, "36.6%"), 1: (121877, 43924, "64.0%")}


@pytest.mark.parametrize("which", [0, 1], ids=["conversation", "synthetic"])
def test_unbounded_memory_reproduces_the_traces_reuse(traces, zero_profile, which: int) -> None:
    blocks, distinct, shown = EXPECTED[which]
    trace = read_trace(traces[which])
    # the store shared by every engine, nothing evicted, no time for a request to miss another's
    # prefill: every block some earlier request had is a hit (local or loaded), except the few whose
    # earlier request was still queued behind same-instant events (`computing`), every other one not
    r = simulate(trace, SimConfig(4, "round_robin", store_gib=math.inf, engine_kv_gib=math.inf), zero_profile)
    s = r.stats
    assert s["blocks"] == blocks
    assert f"{s['hit_rate']:.1%}" == shown
    assert round((s["hit_rate"] + s["miss_computing"]) * blocks) == blocks - distinct
    assert s["miss_computing"] * blocks <= 10
    assert round(s["cold"] * blocks) == distinct
    assert s["miss_elsewhere"] == s["miss_evicted"] == 0
    # one engine, no store: the same figure from the engine's own prefix cache
    one = simulate(trace, SimConfig(1, "ttft", store_gib=0, engine_kv_gib=math.inf), zero_profile).stats
    assert f"{one['local_hit_rate']:.1%}" == shown and one["store_hit_rate"] == 0
    assert round((one["hit_rate"] + one["miss_computing"]) * blocks) == blocks - distinct


def test_with_real_costs_a_reused_block_is_missed_only_while_its_prefill_runs(traces) -> None:
    """With H100 costs some requests arrive while an earlier request is still prefilling their shared
    prefix: those blocks (and only those) are recomputed, so hits + `computing` misses are exact."""
    trace = read_trace(traces[1])
    blocks, distinct, _ = EXPECTED[1]
    s = simulate(trace, SimConfig(16, "ttft", store_gib=math.inf, engine_kv_gib=math.inf),
                 load_profile("llama3-8b-h100")).stats  # fmt: skip
    assert s["miss_computing"] > 0
    assert round((s["hit_rate"] + s["miss_computing"]) * blocks) == blocks - distinct
    assert s["miss_elsewhere"] == s["miss_evicted"] == 0
    # without the store, blocks another engine computed are out of reach
    off = simulate(trace, SimConfig(16, "round_robin", store_gib=0, engine_kv_gib=math.inf),
                   load_profile("llama3-8b-h100")).stats  # fmt: skip
    assert off["miss_elsewhere"] > 0.1 and off["hit_rate"] < s["hit_rate"] - 0.1
    assert (
        round((off["hit_rate"] + off["miss_computing"] + off["miss_elsewhere"]) * blocks) == blocks - distinct
    )
