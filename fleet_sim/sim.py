"""One simulated fleet on one trace: arrivals, the router (engine.router.decision, imported: the very
decision core `kvstore-engine router` runs, with its per-policy windows, turn and scoring), engines,
kvstore-servers and the shared Valkey tier.

    result = simulate(trace, SimConfig(engines=64, policy="ttft", store_gib=math.inf), profile)

The router sees what the real one sees through KV events: which chunks each engine's prefix cache holds,
which chunks some tier of some store holds, and its own count of requests in flight and prompt tokens
waiting per engine (app.py's bookkeeping: added when it routes, the tokens removed at the first token,
the request at the end). Its costs start at the scoring module's defaults and are calibrated by the
router's own Calibrator from the counters each engine would export (vLLM's prefill time, inter-token
latency, prompt and prefix-hit counters, the connector's load counters), every engine scraped every
`calibrate_s` as the router scrapes them.

Hit accounting is per trace block (512 tokens = two chunks): a block is a hit when all its chunks were
reused, from the engine (local) or the store. A missed block a trace would call reused is classified by
why: `computing` (an earlier request has it but had not finished its prefill), `elsewhere` (another
engine's cache or the store holds it, out of this engine's reach: no store, a save still in flight, or
past a gap in the store's run), `evicted` (nobody holds it any more); `cold` is its first appearance.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.engine.router.calibrate import Calibrator, parse_totals
from kvstore.engine.router.decision import Decider
from kvstore.engine.router.scoring import Costs, Request
from kvstore.fleet_sim.cpu import SharedCPU
from kvstore.fleet_sim.engine import Host, Job, SimEngine
from kvstore.fleet_sim.events import EventLoop
from kvstore.fleet_sim.network import transfer
from kvstore.fleet_sim.profile import Profile
from kvstore.fleet_sim.store import FleetStore, Tier
from kvstore.fleet_sim.trace import CHUNK, ChunkKeys, TraceRequest


class SimulationError(RuntimeError):
    """The simulator broke one of its own invariants (a request lost or served twice)."""


def _router_defaults() -> tuple[float | None, int, float]:
    """max_share (None: no cap), share_window and calibrate_s as `kvstore-engine router` has them."""
    from kvstore.engine.router.router import RouterConfig

    d = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    return d["max_share"], int(d["share_window"]), float(d["calibrate_s"])


ENGINE_BLOCK = 16  # tokens per KV block in kvstore-engine and vLLM (their default block_size)


@dataclass(frozen=True)
class SimConfig:
    engines: int
    policy: str = "ttft"
    store_gib: float = math.inf  # the shared Valkey Cluster tier; 0 = no store
    engine_kv_gib: float | None = None  # None: the profile's
    server_gib: float | None = None  # each kvstore-server's memory tier; None: the profile's
    engines_per_server: int | None = None  # None: the profile's
    calibrate_s: float | None = None  # between the router's scrapes of the metrics; None: its default
    cpu_cores: float | None = None  # CPUs every engine shares (one box); None: each engine its own device
    # seconds between a client and the engines, each way (router and HTTP): a request reaches its engine
    # this long after it is sent, its first token the client this long after the engine made it, and a
    # conversation's next turn, due before the previous one finished, is sent this long after it did
    client_s: float = 0.0
    # the router's costs before its first calibration (None: the scoring module's defaults); the oracle
    # gives it loads that cost nothing, which no scrape would measure (a load of 0 s moves no cost)
    router_costs: Costs | None = None


@dataclass
class Result:
    config: SimConfig
    profile: str
    jobs: list[Job]
    stats: dict[str, Any]

    def row(self) -> dict[str, Any]:
        c = self.config
        return {
            "engines": c.engines,
            "policy": c.policy,
            "store_gib": c.store_gib,
            "engine_kv_gib": c.engine_kv_gib,
            "server_gib": c.server_gib,
            "profile": self.profile,
            **self.stats,
        }


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return math.nan
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def blocks_covered(chunks: int, req: TraceRequest) -> int:
    """Trace blocks of `req` fully inside its first `chunks` chunks."""
    return len(req.hash_ids) if chunks >= req.num_chunks else chunks // req.chunks_per_block


class Fleet:
    def __init__(self, profile: Profile, config: SimConfig, chunk_size: int = CHUNK) -> None:
        if config.engines < 1:
            raise ValueError("engines must be >= 1")
        self.profile = profile
        self.config = config
        self.loop = EventLoop()
        kv_gib = profile.engine_kv_gib if config.engine_kv_gib is None else config.engine_kv_gib
        server_gib = profile.server_gib if config.server_gib is None else config.server_gib
        per_server = config.engines_per_server or profile.engines_per_server
        self.chunk_bytes = profile.chunk_bytes(chunk_size)
        capacity = math.inf if math.isinf(kv_gib) else math.floor(kv_gib * 2**30 / self.chunk_bytes)
        self.server_of = [i // per_server for i in range(config.engines)]
        self.store = FleetStore(self.server_of[-1] + 1, server_gib if config.store_gib > 0 else 0, config.store_gib,
                                profile.server_load_bps, profile.server_aggregate_bps, profile.valkey_load_bps,
                                profile.valkey_aggregate_bps)  # fmt: skip
        max_share, window, calibrate_s = _router_defaults()
        # the router's costs: its defaults, then what its calibrator makes of the engines' counters
        self.calibrator = Calibrator(config.router_costs)
        self.calibrate_s = calibrate_s if config.calibrate_s is None else config.calibrate_s
        # each engine's counters as its /metrics would give them to the Calibrator (all 0 at first)
        self.metrics = [parse_totals("") for _ in range(config.engines)]
        self.scraped_at = -math.inf
        self.names = [str(i) for i in range(config.engines)]
        # the router's decision core, as `kvstore-engine router` keeps it: each engine's requests in
        # flight and tokens waiting, per policy its share of the recent work, the turn
        self.decider = Decider(self.names, config.policy, window, max_share)
        self.where: dict[bytes, set[int]] = {}  # chunk -> engines whose cache holds it
        self.first_seen: dict[bytes, int] = {}  # chunk -> the first request whose prompt had it
        self.computed: set[bytes] = set()  # chunks some engine has published
        self.c = Counter()  # block and byte counters
        self.deferred: dict[int, list[Job]] = {}  # id(job) -> jobs waiting for it to finish
        self.cpu = SharedCPU(self.loop, config.cpu_cores)  # the engines' steps
        self.engines = [SimEngine(i, self._host(i), capacity) for i in range(config.engines)]

    def _host(self, engine: int) -> Host:
        """What engine `engine` is given of the fleet."""
        return Host(self.loop, self.cpu, self.profile, self.store.enabled, self.metrics[engine], self.learn,
                    self.forget, self.admitted, self.computed_upto, self.first_token, self.finished)  # fmt: skip

    # ---- the router's view (KV events) --------------------------------------------------------
    def learn(self, engine: int, key: bytes) -> None:
        self.where.setdefault(key, set()).add(engine)
        self.computed.add(key)

    def forget(self, engine: int, key: bytes) -> None:
        s = self.where.get(key)
        if s is not None:
            s.discard(engine)
            if not s:
                del self.where[key]

    def _local_chunks(self, keys: list[bytes]) -> dict[int, int]:
        """engine -> leading chunks of `keys` its cache holds (engines with none left out)."""
        out: dict[int, int] = {}
        cand = self.where.get(keys[0]) if keys else None
        if not cand:
            return out
        cand = set(cand)
        for i in range(1, len(keys)):
            nxt = cand & self.where.get(keys[i], set())
            for e in cand - nxt:
                out[e] = i
            cand = nxt
            if not cand:
                return out
        for e in cand:
            out[e] = len(keys)
        return out

    def run(self, jobs: list[Job]) -> None:
        """Send `jobs` (in arrival order) and run until everything is done; the fleet keeps its state
        for the next call. Raises SimulationError if a request is lost or served twice."""
        loop = self.loop

        def arrive(i: int) -> None:
            self.arrive(jobs[i])
            if i + 1 < len(jobs):  # the next arrival is scheduled after this one's consequences
                loop.at(jobs[i + 1].req.arrival_s, arrive, i + 1)

        if jobs:
            loop.at(jobs[0].req.arrival_s, arrive, 0)
        loop.run()
        bad = [j.req.index for j in jobs if j.served != 1]
        if bad:
            raise SimulationError(f"{len(bad)} requests not served exactly once, first: {bad[:5]}")

    def arrive(self, job: Job) -> None:
        """A request is due: routed now, or when the request it must follow has finished."""
        if job.after is not None and not job.after.served:
            self.deferred.setdefault(id(job.after), []).append(job)
        else:
            self.route(job)

    def route(self, job: Job) -> None:
        req, n = job.req, job.req.input_tokens
        job.sent_s = self.loop.now
        # what the router knows: each engine's prefix of the prompt (KV events), the store's
        held = {self.names[e]: min(c * req.chunk_size, n) for e, c in self._local_chunks(job.keys).items()}
        store = min(self.store.leading(job.keys) * req.chunk_size, n) if self.store.enabled else 0
        costs, now = self.calibrator.costs, self.loop.now
        choice = self.decider.decide(Request(n, store), costs, lambda e: held.get(e, 0), job.policy, now)
        job.engine = int(choice.engine)
        job.policy = choice.policy
        # the router's bookkeeping: in flight, its tokens to compute waiting (loads queue no one)
        job.router_pending = self.decider.add_load(choice)
        for key in job.keys:
            self.first_seen.setdefault(key, req.index)
        self._later(self._reach, job)

    def _reach(self, job: Job) -> None:
        job.reached_s = self.loop.now
        self.engines[job.engine].submit(job)

    # ---- callbacks from the engines -----------------------------------------------------------
    def admitted(self, job: Job, engine: SimEngine) -> None:
        req, c = job.req, self.c
        server = self.server_of[engine.index]
        sizes = [req.chunk_tokens(i) * self.profile.kv_bytes_per_token for i in range(req.num_chunks)]
        tiers: list[Tier] = (
            self.store.lookup(server, job.keys, job.local, sizes) if self.store.enabled else []
        )
        job.loaded = len(tiers)
        reused = job.local + job.loaded
        # a prompt cached whole still recomputes its last engine block (its last token's logits)
        most = (req.input_tokens - 1) // ENGINE_BLOCK * ENGINE_BLOCK
        reused_tokens = min(_tokens(req, reused), most)
        job.prefill_left = req.input_tokens - reused_tokens
        job.decode_left = req.output_tokens - 1
        hit = blocks_covered(reused, req)
        local_blocks = blocks_covered(job.local, req)
        c["blocks"] += len(req.hash_ids)
        c["local_blocks"] += local_blocks
        c["store_blocks"] += hit - local_blocks
        job.local_tokens = min(_tokens(req, job.local), most)
        job.store_tokens = reused_tokens - job.local_tokens
        c["computed_tokens"] += job.prefill_left
        for j in range(hit, len(req.hash_ids)):
            key = job.keys[max(j * req.chunks_per_block, reused)]  # the block's first chunk not reused
            if self.first_seen[key] == req.index:
                c["cold_blocks"] += 1
            elif key not in self.computed:
                c["computing_blocks"] += 1
            elif key in self.where or self.store.holds(key):
                c["elsewhere_blocks"] += 1
            else:
                c["evicted_blocks"] += 1
        if not tiers:
            engine.ready.append(job)
            return
        nbytes = sum(sizes[job.local : reused])
        hops = max(t.hops for t in tiers)
        links = [engine.nic, *{id(t.link): t.link for t in tiers}.values()]
        if any(t.hops == 2 for t in tiers):
            links.append(self.store.server_links[server])
        c["load_bytes"] += sum(sizes[job.local + k] * t.hops for k, t in enumerate(tiers))
        per_stream = min(t.load_bps for t in tiers)
        done = transfer(self.loop.now, nbytes, links, per_stream, hops * self.profile.hop_latency_s)
        engine.loading += 1
        job.load_s = done - self.loop.now
        self.loop.at(done, engine.loaded, job)

    def _count(self, job: Job, now: float) -> None:
        """The engines' counters the router calibrates from; it scrapes every engine every calibrate_s."""
        m = self.metrics[job.engine]
        m["prefill_s"] += now - job.scheduled_s + job.load_s  # vLLM's prefill phase includes the load
        m["prompt"] += job.req.input_tokens
        m["local_hits"] += job.local_tokens
        m["store_hits"] += job.store_tokens
        m["load_s"] += job.load_s
        m["loaded"] += job.store_tokens
        if self.calibrate_s > 0 and now - self.scraped_at >= self.calibrate_s:
            self.scraped_at = now
            for name, counters in zip(self.names, self.metrics, strict=True):
                self.calibrator.observe_totals(name, dict(counters))

    def first_token(self, job: Job, engine: SimEngine) -> None:
        now = self.loop.now
        job.first_token_s = job.last_token_s = now
        job.ttft_s = now + self.config.client_s - job.sent_s
        self._count(job, now)
        self.decider.computed(self.names[job.engine], job.router_pending)
        job.router_pending = 0
        self.computed_upto(job, engine, len(job.keys))

    def computed_upto(self, job: Job, engine: SimEngine, upto: int) -> None:
        """`job` computed its prompt's chunks before chunk `upto` (a prefill step ended): they join the
        engine's cache, and the connector saves them to the store (those no earlier step saved)."""
        engine.publish(job, upto)
        if not self.store.enabled:
            return
        req, now = job.req, self.loop.now
        start = max(job.local + job.loaded, job.saved)
        job.saved = max(job.saved, upto)
        todo = [i for i in range(start, min(upto, len(job.keys))) if not self.store.holds(job.keys[i])]
        if not todo:
            return
        keys = [job.keys[i] for i in todo]
        sizes = [req.chunk_tokens(i) * self.profile.kv_bytes_per_token for i in todo]
        server = self.server_of[engine.index]
        links = [engine.nic, self.store.server_links[server]]
        if self.store.valkey is not None:
            links.append(self.store.valkey.link)
        hops = 1 + (self.store.valkey is not None)
        self.c["save_bytes"] += sum(sizes) * hops
        done = transfer(now, sum(sizes), links, math.inf, hops * self.profile.hop_latency_s)
        if done <= now:  # no time: stored before anything else happens
            self.store.save(server, keys, sizes)
        else:
            self.loop.at(done, self.store.save, server, keys, sizes)

    def finished(self, job: Job, engine: SimEngine) -> None:
        job.finish_s = self.loop.now
        job.served += 1
        self.decider.finished(self.names[job.engine], job.policy or self.config.policy, True)
        for later in self.deferred.pop(id(job), ()):
            self._later(self.route, later)

    def _later(self, fn: Callable[[Job], None], job: Job) -> None:
        """`fn(job)` one client hop from now."""
        if self.config.client_s > 0:
            self.loop.at(self.loop.now + self.config.client_s, fn, job)
        else:
            fn(job)


def _tokens(req: TraceRequest, chunks: int) -> int:
    """Prompt tokens in the first `chunks` chunks of `req`."""
    return min(chunks * req.chunk_size, req.input_tokens)


def simulate(
    trace: list[TraceRequest], config: SimConfig, profile: Profile, keys: ChunkKeys | None = None
) -> Result:
    """Run `trace` through a fleet; raises SimulationError if a request is lost or served twice."""
    keys = keys or ChunkKeys()
    return run_jobs([Job(r, keys.of(r)) for r in trace], config, profile)


def run_jobs(jobs: list[Job], config: SimConfig, profile: Profile) -> Result:
    """Run `jobs` (in arrival order) through a fleet."""
    started = time.perf_counter()
    fleet = Fleet(profile, config, jobs[0].req.chunk_size if jobs else CHUNK)
    fleet.run(jobs)
    return Result(config, profile.name, jobs, _stats(fleet, jobs, time.perf_counter() - started))


def _stats(fleet: Fleet, jobs: list[Job], wall_s: float) -> dict[str, Any]:
    c = fleet.c
    blocks = c["blocks"] or 1
    ttft = sorted(j.ttft_s for j in jobs)
    span = max(j.finish_s for j in jobs) - min(j.sent_s for j in jobs)
    out_tokens = sum(j.req.output_tokens for j in jobs)
    moved = c["load_bytes"] + c["save_bytes"]
    per_engine = Counter(j.engine for j in jobs)
    prompt = sum(j.req.input_tokens for j in jobs)
    return {
        "requests": len(jobs),
        "blocks": c["blocks"],
        "hit_rate": (c["local_blocks"] + c["store_blocks"]) / blocks,
        "local_hit_rate": c["local_blocks"] / blocks,
        "store_hit_rate": c["store_blocks"] / blocks,
        "miss_computing": c["computing_blocks"] / blocks,
        "miss_elsewhere": c["elsewhere_blocks"] / blocks,
        "miss_evicted": c["evicted_blocks"] / blocks,
        "cold": c["cold_blocks"] / blocks,
        # prompt tokens not prefilled (reused from the engine's cache or the store) / prompt tokens
        "prefix_reuse": sum(j.local_tokens + j.store_tokens for j in jobs) / prompt if prompt else 0.0,
        "local_reuse": sum(j.local_tokens for j in jobs) / prompt if prompt else 0.0,
        # the busiest engine's requests / the mean per engine (1.0: even)
        "imbalance": max(per_engine.values()) * fleet.config.engines / len(jobs) if jobs else 0.0,
        "engines_used": len(per_engine),
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p90_s": _quantile(ttft, 0.9),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "throughput_tok_s": out_tokens / span if span > 0 else math.inf,
        "requests_per_s": len(jobs) / span if span > 0 else math.inf,
        "bytes_moved_per_request": moved / len(jobs),
        "load_bytes_per_request": c["load_bytes"] / len(jobs),
        "save_bytes_per_request": c["save_bytes"] / len(jobs),
        "computed_tokens_per_request": c["computed_tokens"] / len(jobs),
        "store_evictions": fleet.store.evictions(),
        "oversize": sum(e.oversize for e in fleet.engines),
        "events": fleet.loop.processed,
        "wall_s": wall_s,
    }
