"""The scoring module (pure: the fleet simulator runs it too) and the event-fed prefix index."""

from __future__ import annotations

import pytest
from kvstore.engine.router.calibrate import Calibrator
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.router.router import Router, RouterConfig
from kvstore.engine.router.scoring import HOT_WEIGHT, Costs, EngineState, Request, choose, estimate, hot_cost
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

COSTS = Costs(prefill_s_per_token=1e-3, load_s_per_token=1e-4, step_s_per_request=0.01)


def test_estimate_splits_the_prompt_into_local_store_and_computed() -> None:
    e = EngineState("a", local_tokens=256, in_flight=2, waiting_tokens=100)
    ttft, local, load, compute = estimate(e, Request(1000, store_tokens=768), COSTS)
    assert (local, load, compute) == (256, 512, 232)
    assert ttft == pytest.approx(100e-3 + 2 * 0.01 + 512e-4 + 232e-3)
    # the last prompt token is always computed, even when everything is cached
    assert estimate(EngineState("a", 1000), Request(1000, 1000), COSTS)[1:] == (999, 0, 1)


def test_policies() -> None:
    engines = [
        EngineState("hot", local_tokens=900, in_flight=6, waiting_tokens=3000),
        EngineState("idle", local_tokens=0),
        EngineState("warm", local_tokens=500, in_flight=1, waiting_tokens=100),
    ]
    req = Request(1000, store_tokens=900)
    assert choose("prefix", engines, req, COSTS).engine == "hot"  # longest match, whatever its queue
    assert choose("least_loaded", engines, req, COSTS).engine == "idle"
    assert [choose("round_robin", engines, req, COSTS, turn=t).engine for t in range(4)] == [
        "hot", "idle", "warm", "hot"]  # fmt: skip
    # ttft: "idle" loads 900 tokens from the store (0.09 s), computes 100; "warm" loads 400 but queues
    c = choose("ttft", engines, req, COSTS)
    assert c.engine == "idle" and (c.local_tokens, c.store_tokens, c.compute_tokens) == (0, 900, 100)
    # without the store, the local prefix wins
    assert choose("ttft", engines, Request(1000), COSTS).engine == "warm"
    with pytest.raises(ValueError):
        choose("random", engines, req, COSTS)


def test_a_hot_engine_costs_the_queueing_it_adds() -> None:
    """No cap (issue 46 item 3): an engine over its fair share of the recent decisions costs HOT_WEIGHT x
    (share - 1) x the request's compute there. A conversation's next turn, little to compute where its
    history is, stays on the hot engine that holds it; a cold prompt, whose 512-token match (a shared
    system prompt) saves less than the queueing it would add, goes to an engine at its fair share."""
    hot = EngineState("hot", local_tokens=512, recent=30)
    fair = [EngineState("x", recent=10), EngineState("y", recent=10)]
    mean = 50 / 3
    assert hot_cost(fair[0], 1000, mean, COSTS) == 0.0, "at or below a fair share, nothing"
    assert hot_cost(hot, 1000, mean, COSTS) == pytest.approx(HOT_WEIGHT * (31 / (mean + 1) - 1) * 1.0)
    cold = choose("ttft", [hot, *fair], Request(4000), COSTS)
    assert cold.engine in ("x", "y") and cold.capped == ("hot",), "the best estimate, passed over as hot"
    assert cold.estimates["hot"] < cold.predicted_ttft_s
    turn = choose("ttft", [EngineState("hot", local_tokens=3900, recent=30), *fair], Request(4000), COSTS)
    assert turn.engine == "hot" and turn.capped == () and turn.compute_tokens == 100
    # at a fair share the local match wins, however small
    assert choose("ttft", [EngineState("a", 512, recent=10), *fair], Request(4000), COSTS).engine == "a"


def test_share_cap_passes_over_an_engine_with_too_many_recent_requests() -> None:
    engines = [
        EngineState("a", local_tokens=900, recent=10),
        EngineState("b", recent=3),
        EngineState("c", recent=3),
    ]
    capped = choose("ttft", engines, Request(1000), COSTS, max_share=1.2)
    assert capped.engine != "a" and capped.capped == ("a",)
    assert capped.estimates["a"] < capped.estimates[capped.engine], "a was the best estimate, passed over"
    assert choose("ttft", engines, Request(1000), COSTS, max_share=3.0).engine == "a"
    few = [EngineState("a", local_tokens=900, recent=4), EngineState("b"), EngineState("c")]
    assert choose("ttft", few, Request(1000), COSTS, max_share=1.2).engine == "a", "first turns stay"


def _stored(hashes, parent, tokens, bs=4, medium="GPU"):
    return BlockStored(hashes, parent, tokens, bs, None, medium, None)


def test_index_matches_tokens_and_forgets_removed_and_cleared_blocks() -> None:
    idx = PrefixIndex()
    idx.apply_engine(
        "e", [_stored([b"h1", b"h2"], None, list(range(8))), _stored([b"h3"], b"h2", [8, 9, 10, 11])]
    )
    assert idx.local_tokens("e", list(range(20))) == 12
    assert idx.local_tokens("e", [0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert idx.local_tokens("other", list(range(20))) == 0
    idx.apply_engine("e", [BlockRemoved([b"h2"], "GPU")])
    assert idx.local_tokens("e", list(range(20))) == 4, "a removed block ends the match"
    idx.apply_engine("e", [AllBlocksCleared()])
    assert idx.local_tokens("e", list(range(20))) == 0
    idx.apply_store(
        "s", [_stored([b"k1", b"k2", b"k3"], None, [], 0, "CPU"), _stored([b"k1"], None, [], 0, "STORAGE")]
    )
    assert idx.store_chunks([b"k1", b"k2", b"k3", b"k4"]) == 3
    idx.apply_store("s", [BlockRemoved([b"k1", b"k2"], "CPU")])
    assert idx.store_chunks([b"k1", b"k2", b"k3"]) == 1, "k1 is still on disk; k2 is gone"


def test_costs_come_from_the_engines_metrics() -> None:
    def text(prompt, hits, prefill_s, load_s, loaded):
        return (
            f'vllm:prompt_tokens_total{{model_name="m"}} {prompt}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
            f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {prefill_s}\n'
            f"kvstore_connector_load_seconds_sum {load_s}\nkvstore_connector_loaded_tokens_total {loaded}\n"
        )

    cal = Calibrator()
    cal.observe("e", text(0, 0, 0, 0, 0))
    cal.observe("e", text(2000, 1000, 2.2, 0.2, 1000))  # 1000 computed in 2.0 s, 1000 loaded in 0.2 s
    assert cal.costs.prefill_s_per_token == pytest.approx(2e-3)
    assert cal.costs.load_s_per_token == pytest.approx(2e-4)
    cal.observe("e", text(2010, 1000, 2.3, 0.2, 1000))  # too few tokens to move anything
    assert cal.costs.prefill_s_per_token == pytest.approx(2e-3)


def test_the_step_cost_is_the_engines_decode_step_under_load() -> None:
    """A cost's first measurement replaces its default, whichever cost was measured before it (the step
    cost, first seen after the prefill cost, was blended into the 0.01 s default at 70%)."""

    def text(prompt, prefill_s, itl_s, steps):
        return (
            f'vllm:prompt_tokens_total{{model_name="m"}} {prompt}\n'
            f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {prefill_s}\n'
            f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {itl_s}\n'
            f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {steps}\n'
        )

    cal = Calibrator()
    cal.observe("e", text(0, 0, 0, 0))
    cal.observe("e", text(1000, 1.0, 0, 0))  # a prefill, no decode steps yet
    assert cal.costs.step_s_per_request == Costs().step_s_per_request
    cal.observe("e", text(1000, 1.0, 0.6, 20))  # 20 steps of 30 ms: two other engines share the CPUs
    assert cal.costs.step_s_per_request == pytest.approx(0.03)
    assert cal.costs.prefill_s_per_token == pytest.approx(1e-3)
    cal.observe("e", text(1000, 1.0, 0.6 + 20 * 0.01, 40))  # idle neighbours: 10 ms steps
    assert cal.costs.step_s_per_request == pytest.approx(0.7 * 0.03 + 0.3 * 0.01)


def test_the_router_counts_only_tokens_to_compute_as_queue() -> None:
    """A request that loads 900 tokens from the store and computes 100 queues the next one behind 100
    (the load runs beside the engine's steps); it counted 1,000."""
    config = RouterConfig(["http://e"], ["ipc:///nonexistent"], [None], calibrate_s=0)
    router = Router(config, tokens=None)  # add_load reads no tokens
    choice = choose("ttft", [EngineState("http://e")], Request(1000, store_tokens=900), COSTS)
    assert (choice.store_tokens, choice.compute_tokens) == (900, 100)
    assert router.decision_record(choice)["loads"] == {"http://e": [0, 0]}
    assert router.add_load(choice) == 100
    load = router.loads["http://e"]
    assert (load.in_flight, load.waiting_tokens) == (1, 100)
    assert router.decision_record(choice)["loads"] == {"http://e": [1, 100]}


def test_ties_favour_no_engine_by_its_index() -> None:
    """Equal engines: each policy's pick is drawn by the decision's turn (the same turn, the same pick),
    spread over every engine rather than the first in the list (issue 46 item 2)."""
    idle = [EngineState(str(i)) for i in range(128)]
    for policy in ("least_loaded", "prefix", "ttft"):
        picks = [choose(policy, idle, Request(1000), COSTS, turn=t).engine for t in range(2000)]
        counts = {name: picks.count(name) for name in {e.name for e in idle}}
        assert len(counts) == 128 and min(counts.values()) >= 4 and max(counts.values()) <= 35, policy
        assert picks == [choose(policy, idle, Request(1000), COSTS, turn=t).engine for t in range(2000)]
    # only the tied engines are drawn from: a busier or shorter-matching one is never picked
    mixed = [EngineState("busy", waiting_tokens=10), EngineState("x"), EngineState("y")]
    assert {choose("least_loaded", mixed, Request(10), COSTS, turn=t).engine for t in range(50)} == {"x", "y"}
    holders = [EngineState("a", 512), EngineState("b"), EngineState("c", 512)]
    assert {choose("prefix", holders, Request(1000), COSTS, turn=t).engine for t in range(50)} == {"a", "c"}
