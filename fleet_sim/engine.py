"""A simulated engine: a local prefix cache in store chunks (256 tokens) and vLLM-style continuous batching.

- Admission (FIFO, at most `max_num_seqs` requests): the request's leading chunks already in the engine
  are reused; memory for the rest of its prompt and all its output is reserved, evicting cached chunks
  LRU (the free-block queue of vLLM and kvstore-engine); the head of the queue waits while it does not
  fit (alone on an empty engine it is admitted anyway, and counted as oversize).
- Then the store's leading chunks are loaded (the fleet decides from where and how long it takes), and
  the request queues for prefill.
- A step prefills up to `max_batched_tokens` (minus one per decoding request) from the queue head and
  decodes one token for every running request; it takes prefill_step_s + each prefilled token's
  prefill_s_per_token (+ prefill_s_per_token_ctx per token before it, + save_s_per_token with a store)
  + decode_s(batch, their context). The first token comes with the end of a request's last prefill
  step. Prompt chunks join the prefix cache (and the router's index) as kvstore-engine caches its
  blocks: loaded ones when their load finishes, computed ones at the end of the step that filled them,
  the last partial one with the first token (a twin computed concurrently stays anonymous, as in
  vLLM); the connector saves the computed ones to the store at the same points.
- Engines sharing `cpu_cores` (one box's CPUs, as in benchmarks/bench_router.py) share them as the OS
  does (`cpu.SharedCPU`): with more engines in a step than cores, each step runs at cores / busy of
  its speed, re-divided whenever a step starts or ends.
- Steps with nothing to prefill are simulated k at a time (k = the fewest tokens any running request
  still needs), cut short at the next step boundary when new work arrives.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.fleet_sim.cpu import SharedCPU
from kvstore.fleet_sim.events import EventLoop
from kvstore.fleet_sim.network import Link
from kvstore.fleet_sim.profile import Profile
from kvstore.fleet_sim.store import UNBOUNDED
from kvstore.fleet_sim.trace import TraceRequest

from kvstore.lru import Entry, LRUIndex


@dataclass(eq=False)
class Job:
    """A request's life in the fleet."""

    req: TraceRequest
    keys: list[bytes]
    engine: int = -1
    policy: str | None = None  # the request's own policy (X-KVStore-Policy); None: the fleet's
    after: Job | None = None  # sent only once this one finished (the previous turn of a conversation)
    sent_s: float = math.nan  # the client sent it (routed)
    reached_s: float = math.nan  # it reached its engine
    ttft_s: float = math.nan  # as its client sees it
    local_tokens: int = 0
    store_tokens: int = 0
    router_pending: int = 0  # tokens the router counts as waiting on its engine
    local: int = 0  # chunks reused from the engine's cache
    loaded: int = 0  # chunks loaded from the store
    prefill_left: int = 0
    decode_left: int = 0
    reserved: int = 0  # chunks of engine memory reserved and not (yet) shared in the cache
    held: list[bytes] = field(default_factory=list)  # cache chunks it holds a reference on
    scheduled_s: float = math.nan  # its first prefill step began
    load_s: float = 0.0  # seconds its store load took
    saved: int = 0  # its prompt's chunks before this one were sent to the store (or reused)
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    finish_s: float = math.nan
    served: int = 0  # how many times it finished (1, or the simulator is wrong)


@dataclass(frozen=True)
class Host:
    """What an engine is given of its fleet (sim.Fleet makes one per engine), and all it knows of it:
    the clock, the CPUs it shares, the costs, whether a store takes its saves, its own counters as its
    /metrics would give them, and what it tells the fleet."""

    loop: EventLoop
    cpu: SharedCPU
    profile: Profile
    saves: bool  # a store is there: the connector saves what each step computed, inside the step
    metrics: dict[str, float]  # this engine's counters the router scrapes (it adds the decode ones)
    learn: Callable[[int, bytes], None]  # a chunk joined the engine's cache (a KV event to the router)
    forget: Callable[[int, bytes], None]  # a chunk left it (evicted)
    admitted: Callable[[Job, SimEngine], None]  # a request is admitted: the fleet loads its store chunks
    computed_upto: Callable[[Job, SimEngine, int], None]  # a prefill step filled the prompt's chunks before
    first_token: Callable[[Job, SimEngine], None]
    finished: Callable[[Job, SimEngine], None]


class SimEngine:
    def __init__(self, index: int, host: Host, capacity_chunks: float) -> None:
        self.index = index
        self.host = host
        self.capacity = capacity_chunks
        self.nic = Link(f"engine{index}", host.profile.nic_bps)
        self.cache: LRUIndex[None] = LRUIndex(UNBOUNDED)  # cached chunks nobody holds, LRU first
        self.holders: dict[bytes, int] = {}  # chunk -> running requests holding it
        self.reserved = 0
        self.waiting: deque[Job] = deque()
        self.ready: deque[Job] = deque()  # loaded, waiting for prefill
        self.running: list[Job] = []  # decoding
        self.loading = 0
        self.busy = False
        self.version = 0
        self.macro: tuple[float, int] | None = None  # (step s at full speed, steps) of a decode run
        self.oversize = 0
        self.steps = 0

    # ---- memory -------------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return key in self.holders or key in self.cache

    def _used(self) -> int:
        return len(self.holders) + self.reserved + self.cache.used

    def _evict_to_fit(self) -> None:
        while self._used() > self.capacity and len(self.cache):
            key, _ = self.cache.pop_oldest()
            self.host.forget(self.index, key)

    def _hold(self, job: Job, key: bytes) -> None:
        if key in self.holders:
            self.holders[key] += 1
        else:
            self.cache.pop(key)
            self.holders[key] = 1
        job.held.append(key)

    def publish(self, job: Job, upto: int | None = None) -> None:
        """The prompt chunks `job` computed or loaded (up to chunk `upto`) join the prefix cache."""
        for key in job.keys[job.local : upto]:
            if self.has(key):
                continue  # a twin: this copy stays anonymous in job.reserved
            self.holders[key] = 1
            job.held.append(key)
            job.reserved -= 1
            self.reserved -= 1
            self.host.learn(self.index, key)

    def _release(self, job: Job) -> None:
        # tail chunks join the LRU first, so they are evicted first and a shared head (a system prompt)
        # last: kvstore-engine's and vLLM's free queue order (BlockManager.free)
        for key in reversed(job.held):
            n = self.holders[key] - 1
            if n:
                self.holders[key] = n
            else:
                del self.holders[key]
                self.cache.insert(key, Entry(1, None))
        job.held.clear()
        self.reserved -= job.reserved
        job.reserved = 0

    # ---- scheduling ---------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self.kick()

    def kick(self) -> None:
        """New work: start a step, or cut a decode run short at its next step boundary."""
        if not self.busy:
            self._step()
        elif self.macro is not None:
            step_s, k = self.macro
            self.macro = None
            cpu = self.host.cpu
            n = min(k, math.floor(cpu.done(self.index) / step_s) + 1) if step_s > 0 else k
            if n < k:
                self.version += 1
                cpu.resize(self.index, n * step_s, self._end_decode, self.version, n)

    def _admit(self) -> None:
        limit = self.host.profile.max_num_seqs
        while self.waiting and len(self.running) + len(self.ready) + self.loading < limit:
            job = self.waiting[0]
            req = job.req
            local = 0
            while local < len(job.keys) and self.has(job.keys[local]):
                local += 1
            total = math.ceil((req.input_tokens + req.output_tokens) / req.chunk_size)
            need = total - local
            cached_local = sum(1 for k in job.keys[:local] if k not in self.holders)
            after = len(self.holders) + cached_local + self.reserved + need
            idle = not (self.running or self.ready or self.loading or self.reserved)
            if after > self.capacity and not idle:
                return  # head-of-line: waits for memory
            if after > self.capacity:
                self.oversize += 1
            self.waiting.popleft()
            for key in job.keys[:local]:
                self._hold(job, key)
            job.local = local
            job.reserved = need
            self.reserved += need
            self._evict_to_fit()
            self.host.admitted(job, self)

    def loaded(self, job: Job) -> None:
        self.loading -= 1
        # a finished load's blocks are cached (and published) at once
        self.publish(job, job.local + job.loaded)
        self.ready.append(job)
        self.kick()

    def _step(self) -> None:
        self._admit()
        loop, profile = self.host.loop, self.host.profile
        if self.ready:
            budget = max(profile.max_batched_tokens - len(self.running), 1)
            parts: list[tuple[Job, int]] = []
            tokens = 0
            dt = profile.prefill_step_s + profile.decode_s(len(self.running), self._context())
            for job in self.ready:
                if tokens >= budget:
                    break
                n = max(min(job.prefill_left, budget - tokens), 0)
                parts.append((job, n))
                tokens += n
                dt += profile.prefill_s(n, job.req.input_tokens - job.prefill_left)
                if self.host.saves:  # the connector saves what the step computed, inside it
                    dt += n * profile.save_s_per_token
                if math.isnan(job.scheduled_s):
                    job.scheduled_s = loop.now
            self.busy = True
            self.steps += 1
            self.host.cpu.start(self.index, dt, self._end_prefill, parts, list(self.running))
        elif self.running:
            k = max(min(j.decode_left for j in self.running), 1)
            self.busy = True
            step_s = profile.decode_s(len(self.running), self._context())
            self.version += 1
            self.macro = (step_s, k)
            self.host.cpu.start(self.index, k * step_s, self._end_decode, self.version, k)
        else:
            self.busy = False

    def _context(self) -> int:
        """Tokens before the next new token of every decoding request (its prompt and its output)."""
        return sum(j.req.input_tokens + j.req.output_tokens - j.decode_left - 1 for j in self.running)

    def _end_prefill(self, parts: list[tuple[Job, int]], decoders: list[Job]) -> None:
        self._advance(decoders, 1)
        for job, n in parts:
            job.prefill_left -= n
            if job.prefill_left > 0:  # a chunked prefill: the chunks it filled are cached after each step
                self.host.computed_upto(
                    job, self, (job.req.input_tokens - job.prefill_left) // job.req.chunk_size
                )
            else:
                self.ready.remove(job)
                self.host.first_token(job, self)
                if job.decode_left > 0:
                    self.running.append(job)
                else:
                    self._finish(job)
        self.busy = False
        self._step()

    def _end_decode(self, version: int, n: int) -> None:
        if version != self.version:
            return  # superseded: the run was cut short
        self.macro = None
        self.steps += n
        self._advance(list(self.running), n)
        self.busy = False
        self._step()

    def _advance(self, decoders: list[Job], n: int) -> None:
        """`decoders` got `n` tokens each, the last one now (counted as vLLM's inter-token latency)."""
        done = []
        now, m = self.host.loop.now, self.host.metrics
        for job in decoders:
            m["itl_s"] += now - job.last_token_s
            m["itl_n"] += n
            job.last_token_s = now
            job.decode_left -= n
            if job.decode_left <= 0:
                done.append(job)
        for job in done:
            self.running.remove(job)
            self._finish(job)

    def _finish(self, job: Job) -> None:
        self._release(job)
        self.host.finished(job, self)
