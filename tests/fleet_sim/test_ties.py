"""Fair ties (issue 46 item 2): among engines the policy scores alike, none is favoured by its index. Ties
went to the first engine in the list: at 128 engines least_loaded sent every request to engines 0-31
(imbalance 8.5) of the simulated fleet, and the real router runs the same choose()."""

from __future__ import annotations

from kvstore.fleet_sim.profile import load_profile
from kvstore.fleet_sim.sim import SimConfig, simulate
from kvstore.fleet_sim.trace import read_trace


def test_least_loaded_uses_every_engine_of_128(traces) -> None:
    conversation, _ = traces
    trace = read_trace(conversation, limit=800)
    stats = simulate(trace, SimConfig(128, "least_loaded", store_gib=0), load_profile("llama3-8b-h100")).stats
    assert stats["engines_used"] == 128, stats["engines_used"]
    assert stats["imbalance"] < 3, stats["imbalance"]  # 6.25 requests per engine on average
