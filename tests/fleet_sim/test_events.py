"""The event loop runs callbacks in time order (ties in scheduling order), and a simulation serves
every request exactly once, whatever the memory pressure, policy or store."""

from __future__ import annotations

import math

import pytest
from kvstore.engine.router.scoring import POLICIES
from kvstore.fleet_sim.engine import Job
from kvstore.fleet_sim.events import EventLoop
from kvstore.fleet_sim.profile import Profile, load_profile
from kvstore.fleet_sim.sim import SimConfig, SimulationError, run_jobs, simulate
from kvstore.fleet_sim.trace import ChunkKeys, read_trace


def test_events_run_in_time_order_ties_first_come() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []

    def ev(name: str) -> None:
        seen.append((loop.now, name))
        if name == "b":  # scheduled while running: for now, and for the past (clamped to now)
            loop.at(loop.now, ev, "b-now")
            loop.at(0.0, ev, "b-past")
            loop.after(0.5, ev, "b-later")

    for when, name in ((3.0, "d"), (1.0, "a"), (2.0, "b"), (1.0, "a2"), (2.0, "c")):
        loop.at(when, ev, name)
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "a2"), (2.0, "b"), (2.0, "c"), (2.0, "b-now"), (2.0, "b-past"),
                    (2.5, "b-later"), (3.0, "d")]  # fmt: skip
    assert loop.processed == 8 and len(loop) == 0
    with pytest.raises(ValueError):
        loop.at(math.nan, ev, "x")


def test_run_until_leaves_later_events() -> None:
    loop = EventLoop()
    seen: list[int] = []
    for t in (1, 2, 3):
        loop.at(t, seen.append, t)
    loop.run(until=2)
    assert seen == [1, 2] and len(loop) == 1


def _check_served_once(result) -> None:
    for j in result.jobs:
        assert j.served == 1
        assert j.req.arrival_s <= j.sent_s <= j.first_token_s <= j.finish_s
    assert result.stats["requests"] == len(result.jobs)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_is_served_exactly_once(traces, policy: str) -> None:
    trace = read_trace(traces[0], limit=400)
    profile = load_profile("llama3-8b-h100")
    # 2 GiB of engine KV (64 chunks of 32 MiB) and a 64 GiB store: requests wait for memory, both evict
    r = simulate(trace, SimConfig(4, policy, store_gib=64, engine_kv_gib=2), profile)
    _check_served_once(r)
    assert r.stats["store_evictions"] > 0 and r.stats["miss_evicted"] > 0
    assert r.stats["hit_rate"] > 0
    assert r.stats["oversize"] > 0  # a prompt larger than 2 GiB of KV ran alone


def test_a_request_that_follows_another_is_sent_after_it_finished(traces) -> None:
    trace = read_trace(traces[0], limit=50)
    keys = ChunkKeys()
    jobs = [Job(r, keys.of(r)) for r in trace]
    for prev, nxt in zip(jobs, jobs[1:], strict=False):
        nxt.after = prev  # one long conversation
    r = run_jobs(jobs, SimConfig(8, "ttft"), load_profile("llama3-8b-h100"))
    _check_served_once(r)
    for prev, nxt in zip(r.jobs, r.jobs[1:], strict=False):
        assert nxt.sent_s == max(nxt.req.arrival_s, prev.finish_s)


def test_a_request_never_served_is_an_error(traces, zero_profile: Profile) -> None:
    trace = read_trace(traces[0], limit=3)
    keys = ChunkKeys()
    jobs = [Job(r, keys.of(r)) for r in trace]
    jobs[1].after = Job(trace[2], keys.of(trace[2]))  # waits for a request that is never sent
    with pytest.raises(SimulationError, match=r"1 requests not served exactly once, first: \[1\]"):
        run_jobs(jobs, SimConfig(2), zero_profile)


def test_the_client_hop_delays_a_request_and_a_conversations_next_turn() -> None:
    from kvstore.fleet_sim.trace import TraceRequest

    from .conftest import profile_doc

    hop = 0.005
    doc = profile_doc(prefill_s_per_token=1e-4, prefill_step_s=0.002, decode_step_s={"1": 0.01})
    doc["tiers"]["server"] = {"load_gbps": 1, "aggregate_gbps": 1}  # a 1 MB save takes 1 ms
    doc["tiers"]["valkey"] = {"load_gbps": 1, "aggregate_gbps": 1}
    profile = Profile.from_dict(doc)

    def run(client_s: float) -> list[Job]:
        keys = ChunkKeys()
        first = TraceRequest(0, 0.0, 1024, 1, (1, 2))
        second = TraceRequest(1, 0.0, 1536, 1, (1, 2, 3))  # the next turn: due at once, sent when 0 is done
        jobs = [Job(first, keys.of(first)), Job(second, keys.of(second))]
        jobs[1].after = jobs[0]
        config = SimConfig(2, "round_robin", store_gib=1, server_gib=0, client_s=client_s)
        return run_jobs(jobs, config, profile).jobs

    a, b = run(hop)
    assert a.reached_s == pytest.approx(a.sent_s + hop)
    assert a.ttft_s == pytest.approx(a.first_token_s - a.sent_s + hop)  # its first token's way back too
    assert b.sent_s == pytest.approx(a.finish_s + hop)  # the answer's way back to the client
    assert b.engine != a.engine and b.loaded == 4  # by then the first turn's 4 chunks were in the store
    a, b = run(0.0)
    assert b.sent_s == a.finish_s and b.loaded == 0  # sent at once: their save was still on its way
