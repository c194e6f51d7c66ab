"""The cost model: a step's time follows the profile (a decode step grows with the batch as measured,
a prefill costs its tokens), continuous batching lets a request in at the next step boundary, and
every profile gives a source for every number."""

from __future__ import annotations

import json
import math

import pytest
from kvstore.fleet_sim.engine import Job
from kvstore.fleet_sim.profile import PROFILES, Profile, load_profile
from kvstore.fleet_sim.sim import SimConfig, run_jobs
from kvstore.fleet_sim.trace import ChunkKeys, TraceRequest

from kvstore.errors import InvalidArgument

from .conftest import profile_doc

NAMES = sorted(p.stem for p in PROFILES.glob("*.json"))


def test_the_shipped_profiles() -> None:
    assert {"smollm2-cpu", "llama3-8b-h100"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_number_has_a_source(name: str) -> None:
    doc = json.loads((PROFILES / f"{name}.json").read_text())
    assert doc["date"] and doc["machine"]

    def walk(node, path):
        if isinstance(node, dict) and "value" in node:
            assert isinstance(node.get("source"), str) and len(node["source"]) > 10, path
            return
        assert isinstance(node, dict), f"{path}: a bare number, no source"
        for k, v in node.items():
            if k not in ("name", "model", "machine", "date", "derivation", "measured"):
                walk(v, f"{path}.{k}")

    walk({k: v for k, v in doc.items()}, name)
    load_profile(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_decode_step_grows_with_the_batch_as_measured(name: str) -> None:
    p = load_profile(name)
    measured = json.loads((PROFILES / f"{name}.json").read_text())["decode_step_s"]["value"]
    points = sorted((int(b), s) for b, s in measured.items())
    for b, s in points:
        assert p.decode_step_s(b) == pytest.approx(s)
    assert all(s1 <= s2 for (_, s1), (_, s2) in zip(points, points[1:], strict=False)), points
    assert points[-1][1] > points[0][1], points
    # between two measured batches: on the line; beyond the last: along its slope, still growing
    (b0, s0), (b1, s1) = points[-2], points[-1]
    mid = (b0 + b1) // 2
    assert p.decode_step_s(mid) == pytest.approx(s0 + (s1 - s0) * (mid - b0) / (b1 - b0))
    assert p.decode_step_s(2 * b1) > s1
    assert p.decode_step_s(0) == 0


def _jobs(specs, keys=None) -> list[Job]:
    """(arrival s, prompt tokens, output tokens) -> jobs with prompts that share nothing."""
    keys = keys or ChunkKeys()
    out = []
    for i, (t, n, out_tokens) in enumerate(specs):
        ids = tuple(1000 * (i + 1) + j for j in range(math.ceil(n / 512)))
        r = TraceRequest(i, t, n, out_tokens, ids)
        out.append(Job(r, keys.of(r)))
    return out


STEPS = {"1": 0.010, "4": 0.016, "16": 0.040}
TIMED = dict(prefill_s_per_token=1e-4, prefill_step_s=0.002, decode_step_s=STEPS)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_a_batch_decodes_at_the_profile_step_time(batch: int) -> None:
    p = Profile.from_dict(profile_doc(**TIMED))
    out = 51
    r = run_jobs(_jobs([(0.0, 60, out)] * batch), SimConfig(1, "round_robin", store_gib=0), p)
    first, *rest = r.jobs
    # the first arrival starts a step alone; the others, arrived during it, are prefilled in the next
    # one, which also decodes the first; then the whole batch decodes at the profile's step time
    t1 = 0.002 + 60 * 1e-4
    assert first.first_token_s == pytest.approx(t1)
    if not rest:
        assert first.finish_s == pytest.approx(t1 + (out - 1) * STEPS["1"])
        return
    t2 = t1 + 0.002 + 60 * (batch - 1) * 1e-4 + STEPS["1"]
    assert first.finish_s == pytest.approx(t2 + (out - 2) * STEPS[str(batch)])
    for j in rest:
        assert j.first_token_s == pytest.approx(t2)
        assert j.finish_s == pytest.approx(first.finish_s + p.decode_step_s(batch - 1))


def test_a_decode_step_costs_more_the_more_context_its_requests_have() -> None:
    per_ctx = 1e-5
    p = Profile.from_dict(
        {**profile_doc(**TIMED), "decode_s_per_ctx_token": {"value": per_ctx, "source": "a test"}}
    )
    for n in (60, 600):
        (job,) = run_jobs(_jobs([(0.0, n, 4)]), SimConfig(1, store_gib=0), p).jobs
        # three decode steps after the first token, each with the n tokens before the run's first new
        # one (a run of steps is costed at its start's context: 2 tokens short by its end here)
        assert job.finish_s - job.first_token_s == pytest.approx(3 * (STEPS["1"] + per_ctx * n))


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    p = Profile.from_dict(profile_doc(**TIMED))
    r = run_jobs(_jobs([(0.0, 2500, 1)]), SimConfig(1, store_gib=0), p)
    # 1024 + 1024 + 452 tokens: three steps, each with its fixed cost
    assert r.jobs[0].first_token_s == pytest.approx(3 * 0.002 + 2500 * 1e-4)


def test_a_request_joins_a_running_batch_at_the_next_step_boundary() -> None:
    p = Profile.from_dict(profile_doc(**TIMED))
    a_ttft = 0.002 + 100 * 1e-4
    joins = a_ttft + 2.5 * 0.010  # half-way through A's third decode step
    r = run_jobs(_jobs([(0.0, 100, 200), (joins, 100, 3)]), SimConfig(1, store_gib=0), p)
    a, b = r.jobs
    boundary = a_ttft + 3 * 0.010
    # B's prefill step also decodes A (a batch of 1): prefill cost + a decode step of 1
    assert b.first_token_s == pytest.approx(boundary + 0.002 + 100 * 1e-4 + 0.010)
    # then both decode: B's two remaining tokens at batch 2 (between the 1 and 4 points)
    assert b.finish_s == pytest.approx(b.first_token_s + 2 * p.decode_step_s(2))
    assert p.decode_step_s(2) == pytest.approx(0.012)


def test_a_load_from_the_store_costs_its_bytes_over_the_slowest_link() -> None:
    doc = profile_doc(**TIMED)
    doc["tiers"]["valkey"] = {"load_gbps": 1e-3, "aggregate_gbps": 0}  # 1 MB/s
    doc["network"] = {"hop_latency_s": 0.001, "nic_gbps": 0}
    p = Profile.from_dict(doc)
    keys = ChunkKeys()
    first = _jobs([(0.0, 1024, 1)], keys)[0]
    again = Job(TraceRequest(1, 10.0, 1024, 1, first.req.hash_ids), list(first.keys))
    r = run_jobs([first, again], SimConfig(2, "round_robin", store_gib=math.inf), p)
    b = r.jobs[1]
    assert b.engine != r.jobs[0].engine and b.loaded == 4 and b.local == 0
    # 4 chunks x 256 tokens x 1024 bytes at 1 MB/s, 2 hops (engine - server - Valkey), then the last
    # 16-token block: a prompt reused whole still recomputes its last block, as kvstore-engine and vLLM do
    load = 4 * 256 * 1024 / 1e6 + 2 * 0.001
    assert b.first_token_s - b.sent_s == pytest.approx(load + 0.002 + 16 * 1e-4)
    assert (b.store_tokens, b.local_tokens) == (1008, 0)
    assert r.stats["load_bytes_per_request"] == pytest.approx(4 * 256 * 1024 * 2 / 2)


def test_a_prefill_token_costs_more_the_more_context_it_has() -> None:
    p = Profile.from_dict(profile_doc(**TIMED, prefill_s_per_token_ctx=1e-7))
    r = run_jobs(_jobs([(0.0, 2500, 1)]), SimConfig(1, store_gib=0), p)
    steps = [(1024, 0), (1024, 1024), (452, 2048)]
    want = sum(0.002 + n * (1e-4 + 1e-7 * (start + (n - 1) / 2)) for n, start in steps)
    assert r.jobs[0].first_token_s == pytest.approx(want)
    assert p.prefill_s(1024, 1024) > p.prefill_s(1024, 0) > 1024 * 1e-4


def test_the_router_calibrates_its_costs_from_what_the_engines_count(traces) -> None:
    from kvstore.engine.router.scoring import Costs
    from kvstore.fleet_sim.sim import Fleet
    from kvstore.fleet_sim.trace import read_trace

    doc = profile_doc(**TIMED)
    doc["tiers"]["valkey"] = {"load_gbps": 0.1, "aggregate_gbps": 0}
    p = Profile.from_dict(doc)
    fleet = Fleet(p, SimConfig(4, "ttft", store_gib=math.inf, calibrate_s=1.0))
    keys = ChunkKeys()
    fleet.run([Job(r, keys.of(r)) for r in read_trace(traces[0], limit=300)])
    costs = fleet.calibrator.costs
    assert fleet.calibrator.updates > 10 and costs != Costs()
    # prefill: 1e-4 s/token plus each step's 2 ms and the decode steps batched with it (vLLM's prefill
    # time is wall time too); load: 1024 bytes/token at 0.1 GB/s, over the tokens the engine counts
    assert 1e-4 < costs.prefill_s_per_token < 3e-4
    assert costs.load_s_per_token == pytest.approx(1024 / 0.1e9, rel=0.3)
    # a step per request in flight: the inter-token latency, decode steps of the running batch and the
    # prefill steps they share (the real router's measure): between a lone decode step and a full prefill step
    assert (
        STEPS["1"] <= costs.step_s_per_request < 0.25
        and costs.step_s_per_request != Costs().step_s_per_request
    )


def test_the_calibration_fits() -> None:
    from kvstore.fleet_sim.calibrate import fit_decode, fit_prefill

    a, b, c = 1e-3, 2e-6, 0.05
    points = {n: c + a * n + b * n * (n - 1) / 2 for n in (128, 256, 512, 1024, 2048)}
    assert fit_prefill(points) == pytest.approx((a, b, c), rel=1e-6)
    # a negative term is dropped: a linear cost without a fixed part stays linear
    assert fit_prefill({n: 2e-3 * n for n in (100, 200, 400)}) == pytest.approx((2e-3, 0, 0), abs=1e-12)
    # a step's own cost that long prompts alone hide: from scratch the points are as linear as with
    # c = 0, and only a turn with a cached head and few new tokens shows it
    a, b, c = 1e-3, 1e-6, 0.03

    def t(n, cached=0):
        return c + a * n + b * (n * cached + n * (n - 1) / 2)

    scratch = {n: t(n) for n in (128, 256, 512, 1024, 2048)}
    continued = {(cached, n): t(n, cached) for cached, n in ((256, 1), (704, 1), (704, 16), (256, 64))}
    assert fit_prefill(scratch, continued) == pytest.approx((a, b, c), rel=1e-6)
    # decode: the step at zero context and the cost per token of context, from a table measured with
    # short prompts and a few steps after long ones
    d, short = 2e-6, 70

    def zero(b):
        return 0.010 + 0.001 * b

    table = {b: zero(b) + d * b * short for b in (1, 2, 4, 8)}
    long = {(1, 1000): zero(1) + d * 1000, (4, 500): zero(4) + d * 4 * 500}
    got, per_ctx = fit_decode(table, long, short)
    assert per_ctx == pytest.approx(d)
    assert got == pytest.approx({b: zero(b) for b in table})
    # a step never gets faster with a bigger batch, nor with more context
    assert fit_decode({1: 0.02, 8: 0.01}, {}, short) == ({1: 0.02, 8: 0.02}, 0.0)
    assert fit_decode({1: 0.02}, {(1, 1000): 0.01}, short) == ({1: 0.02}, 0.0)


def test_engines_sharing_fewer_cores_run_slower() -> None:
    p = Profile.from_dict(profile_doc(**TIMED))
    dt = 0.002 + 100 * 1e-4
    for cores, both in ((None, dt), (2, dt), (1, 2 * dt), (1.5, 4 / 3 * dt)):
        r = run_jobs(_jobs([(0.0, 100, 1), (0.0, 100, 1)]), SimConfig(2, "round_robin", cpu_cores=cores), p)
        a, b = r.jobs
        assert a.engine != b.engine
        # two steps at once share the cores: each at cores / 2 of its speed (at most full speed)
        assert (a.first_token_s, b.first_token_s) == pytest.approx((both, both))


def test_a_step_slows_down_when_another_engine_starts_one_and_speeds_up_when_it_ends() -> None:
    """Processor sharing: the rate is re-divided whenever a step starts or ends, not fixed at the start."""
    p = Profile.from_dict(profile_doc(**TIMED))
    long, short = 0.002 + 400 * 1e-4, 0.002 + 100 * 1e-4  # 42 ms and 12 ms of work at full speed
    r = run_jobs(_jobs([(0.0, 400, 1), (0.010, 100, 1)]), SimConfig(2, "round_robin", cpu_cores=1), p)
    a, b = r.jobs
    # a runs alone for 10 ms, then both at half speed until b's 12 ms of work are done (24 ms later),
    # a having done 10 + 12 ms by then; then a alone again for its last 20 ms
    assert b.first_token_s == pytest.approx(0.010 + 2 * short)
    assert a.first_token_s == pytest.approx(b.first_token_s + (long - 0.010 - short))


def test_a_decode_run_cut_short_keeps_the_work_it_did_at_the_shared_speed() -> None:
    p = Profile.from_dict(profile_doc(**TIMED))
    step = STEPS["1"]
    # a decodes 50 steps; b arrives on the other engine mid-run: a's steps slow to half speed while
    # b's prefill runs, and a's 50 steps still take 50 steps of work in all
    r = run_jobs(_jobs([(0.0, 100, 51), (0.1, 100, 1)]), SimConfig(2, "round_robin", cpu_cores=1), p)
    a, b = r.jobs
    a_ttft = 0.002 + 100 * 1e-4
    b_work = 0.002 + 100 * 1e-4
    assert b.first_token_s == pytest.approx(0.1 + 2 * b_work)
    assert a.finish_s == pytest.approx(a_ttft + 50 * step + b_work)


def test_saving_what_a_step_computed_costs_the_engine_only_with_a_store() -> None:
    p = Profile.from_dict(profile_doc(**TIMED, save_s_per_token=2e-5))
    bare = run_jobs(_jobs([(0.0, 600, 1)]), SimConfig(1, store_gib=0), p).jobs[0]
    saved = run_jobs(_jobs([(0.0, 600, 1)]), SimConfig(1, store_gib=math.inf), p).jobs[0]
    assert bare.first_token_s == pytest.approx(0.002 + 600 * 1e-4)
    assert saved.first_token_s == pytest.approx(0.002 + 600 * (1e-4 + 2e-5))
    with pytest.raises(InvalidArgument, match="costs must be >= 0"):
        Profile.from_dict(profile_doc(**TIMED, save_s_per_token=-1e-5))


def test_the_router_sees_chunks_as_the_engine_caches_them() -> None:
    """As kvstore-engine caches (and publishes) its blocks: a load's when the load finishes, a chunked
    prefill's at the end of each step, not all at the first token; the connector saves them as they come."""
    from kvstore.fleet_sim.sim import Fleet

    doc = profile_doc(**TIMED)
    doc["tiers"]["valkey"] = {"load_gbps": 1e-3, "aggregate_gbps": 0}  # 1 MB/s: a 1 s load
    doc["network"] = {"hop_latency_s": 0.001, "nic_gbps": 0}
    p = Profile.from_dict(doc)
    keys = ChunkKeys()
    first = _jobs([(0.0, 1024, 1)], keys)[0]
    fleet = Fleet(p, SimConfig(2, "round_robin", store_gib=math.inf))
    fleet.run([first])
    assert first.engine == 0 and all(fleet.store.holds(k) for k in first.keys)
    # the same 1,024 tokens, then 2,048 of its own: loads 4 chunks, then prefills 2 steps of 1,024
    r = TraceRequest(1, 10.0, 3072, 1, (*first.req.hash_ids, 7001, 7002, 7003, 7004))
    job = Job(r, keys.of(r))
    fleet.loop.at(10.0, fleet.arrive, job)
    load_end = 10.0 + 4 * 256 * 1024 / 1e6 + 2 * 0.001
    step = 0.002 + 1024 * 1e-4

    def on_engine_1() -> list[int]:
        return [i for i, k in enumerate(job.keys) if 1 in fleet.where.get(k, ())]

    fleet.loop.run(until=load_end - 0.01)
    assert job.engine == 1 and on_engine_1() == []
    fleet.loop.run(until=load_end + step / 2)
    assert on_engine_1() == [0, 1, 2, 3]
    fleet.loop.run(until=load_end + step * 1.5)
    assert on_engine_1() == list(range(8)) and math.isnan(job.first_token_s)
    assert all(fleet.store.holds(k) for k in job.keys[4:8]) and not fleet.store.holds(job.keys[8])
    fleet.loop.run()
    assert on_engine_1() == list(range(12)) and job.first_token_s == pytest.approx(load_end + 2 * step)
    assert all(fleet.store.holds(k) for k in job.keys)


def test_shared_cpu_a_stale_end_event_never_ends_the_next_step() -> None:
    from kvstore.fleet_sim.cpu import SharedCPU
    from kvstore.fleet_sim.events import EventLoop

    loop = EventLoop()
    cpu = SharedCPU(loop, cores=1)
    ends: list[tuple[str, float]] = []

    def a_done() -> None:
        ends.append(("a", loop.now))
        cpu.start(0, 5.0, lambda: ends.append(("c", loop.now)))  # engine 0's next step

    # b, then a, start at half speed (a's end first planned at 2.0); b ends at 0.4, a speeds up and
    # ends at 1.2; the end planned at 2.0 is stale and must not end c, which needs 5 s alone
    cpu.start(1, 0.2, lambda: ends.append(("b", loop.now)))
    cpu.start(0, 1.0, a_done)
    loop.run()
    assert ends == [("b", pytest.approx(0.4)), ("a", pytest.approx(1.2)), ("c", pytest.approx(6.2))]
    assert cpu.work_s == pytest.approx(6.2) and not cpu.runs
