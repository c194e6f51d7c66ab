"""Where a request should go: one pure function over the engines' state (no I/O, no clock), used by
`kvstore-engine router` and by the fleet simulator (fleet_sim/) alike.

    choose(policy, engines, request, costs) -> Choice

An engine's estimated time to first token for a request is

    queueing  = its tokens waiting to be computed x prefill cost + requests in flight x step cost
    + remote  = tokens the shared store has beyond the engine's own prefix x load cost
    + compute = tokens nobody has x prefill cost          (at least the last prompt token)

with costs per token calibrated from the engines' own metrics (kvstore.engine.router.calibrate). Tokens an
engine is still loading from the store are not its queue: a load runs beside the engine's steps (the
scheduler computes other requests while a request's KV arrives), so `waiting_tokens` counts only the
tokens the engine will compute. Policies:
`round_robin`, `least_loaded` (fewest tokens waiting, then fewest in flight), `prefix` (the longest
local match: the classic KV-aware router, which hot-spots an engine holding a popular prefix) and
`ttft`: the lowest estimate plus what a hot spot costs,

    + hot     = HOT_WEIGHT x (share - 1) x compute        (engines above their fair share only)

where `share` is the engine's part of the router's recent decisions over a fair part ((its recent + 1)
/ (the mean's + 1)). An engine that has been taking s times its fair share will keep getting s - 1 more
requests than its peers; those that land while this request computes wait for it. That is the queueing
the hot spot adds, priced in the request's own compute (the part of its prompt the engine lacks): a
conversation's next turn, which the engine holding its history computes little of, stays there; a cold
prompt, which costs as much anywhere, goes where it queues no one. It replaces a fixed share cap (an
engine over `max_share` times its fair share was passed over), which moved long conversations off the
engine that held them once they had made it "hot": at 256 simulated engines on the Mooncake conversation
trace without a store the cap kept 25% of the prompt tokens, this rule 37% (of 37% possible). The cap is
still there when asked for (`max_share`), on top.

Ties (equal scores) go to an engine drawn by the decision's `turn`, never by its place in the list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("round_robin", "least_loaded", "prefix", "ttft")
# the share of a hot engine's excess followers that wait for a request's compute, each half of it on
# average: a quarter of (share - 1) x compute. Chosen on the fleet simulator (fleet_sim/, the
# conversation trace, 8 to 256 engines): 1/2 had TTFT p90 0.6-1.3% worse at 8 engines, where the queues
# already price the load; 1/4 is no worse than the share cap at any size, and 8-23% better from 32 up.
HOT_WEIGHT = 0.25


@dataclass(frozen=True)
class Costs:
    """Seconds per token (prefill, load from the store), per request in flight (one decode step under
    the engines' current load), and a constant. The defaults are a start for a router that has not
    read an engine's metrics yet."""

    prefill_s_per_token: float = 1e-3
    load_s_per_token: float = 1e-4
    step_s_per_request: float = 0.01
    base_s: float = 0.0


@dataclass(frozen=True)
class EngineState:
    name: str
    local_tokens: int = 0  # leading prompt tokens in the engine's own prefix cache
    in_flight: int = 0  # requests sent to it and not finished
    waiting_tokens: int = 0  # prompt tokens it has been sent to compute and not yet computed (no loads)
    recent: int = 0  # decisions for it among the router's recent ones (its share: the hot-spot cost)


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    store_tokens: int = 0  # leading prompt tokens the shared store holds


@dataclass(frozen=True)
class Choice:
    engine: str
    policy: str
    predicted_ttft_s: float
    local_tokens: int  # reused from the engine's cache
    store_tokens: int  # loaded from the store
    compute_tokens: int  # prefilled
    estimates: dict[str, float] = field(default_factory=dict)  # every engine's estimated TTFT
    capped: tuple[str, ...] = ()  # engines with a lower estimate passed over as hot (ttft: cost or cap)


def estimate(engine: EngineState, request: Request, costs: Costs) -> tuple[float, int, int, int]:
    """(estimated TTFT s, local tokens, store tokens, compute tokens) of `request` on `engine`."""
    n = request.prompt_tokens
    local = min(engine.local_tokens, n - 1)
    reused = max(local, min(request.store_tokens, n - 1))
    load, compute = reused - local, n - reused
    queue = engine.waiting_tokens * costs.prefill_s_per_token + engine.in_flight * costs.step_s_per_request
    ttft = costs.base_s + queue + load * costs.load_s_per_token + compute * costs.prefill_s_per_token
    return ttft, local, load, compute


def hot_cost(engine: EngineState, compute_tokens: int, mean_recent: float, costs: Costs) -> float:
    """Seconds the queueing on a hot engine adds for `compute_tokens` computed there: HOT_WEIGHT x (its
    share of the recent decisions over a fair share - 1) x their prefill time; 0 at or below a fair
    share."""
    share = (engine.recent + 1) / (mean_recent + 1)
    return HOT_WEIGHT * max(share - 1.0, 0.0) * compute_tokens * costs.prefill_s_per_token


def under_cap(engines: Sequence[EngineState], max_share: float) -> list[EngineState]:
    """The engines that may take one more request without exceeding `max_share` x a fair share of the
    recent decisions; every engine while there are fewer than two recent decisions per engine (a
    conversation's first turns stay together) and when none may."""
    total = sum(e.recent for e in engines) + 1
    if total <= 2 * len(engines):
        return list(engines)
    ok = [e for e in engines if e.recent + 1 <= max_share * total / len(engines)]
    return ok or list(engines)


def _mix(x: int) -> int:
    """splitmix64's finaliser: consecutive turns give unrelated 64-bit numbers."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _lowest(engines: Sequence[EngineState], key: Callable[[EngineState], Any], turn: int) -> EngineState:
    """The engine with the lowest `key`; among equal keys one drawn by the decision's `turn` (a
    pseudo-random pick, the same for the same turn), so no engine is favoured by its place in the list
    (ties went to the first: at 128 idle engines least_loaded used engines 0-31 only)."""
    keys = [key(e) for e in engines]
    best = min(keys)
    tied = [e for e, k in zip(engines, keys, strict=True) if k == best]
    return tied[_mix(turn) % len(tied)] if len(tied) > 1 else tied[0]


def choose(
    policy: str,
    engines: Sequence[EngineState],
    request: Request,
    costs: Costs = Costs(),
    max_share: float | None = None,
    turn: int = 0,
) -> Choice:
    """The engine `policy` picks for `request`. `turn` is the caller's count of its decisions:
    round_robin's counter, and the draw that breaks ties between equal engines. `max_share` (ttft): also
    pass over engines above that many times their fair share of the recent decisions (None: no cap)."""
    if not engines:
        raise ValueError("no engines to choose from")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    scored = {e.name: estimate(e, request, costs) for e in engines}
    capped: tuple[str, ...] = ()
    if policy == "round_robin":
        best = engines[turn % len(engines)]
    elif policy == "least_loaded":
        best = _lowest(engines, lambda e: (e.waiting_tokens, e.in_flight), turn)
    elif policy == "prefix":
        best = _lowest(engines, lambda e: (-scored[e.name][1], e.in_flight, e.waiting_tokens), turn)
    else:
        allowed = list(engines) if max_share is None else under_cap(engines, max_share)
        mean_recent = sum(e.recent for e in engines) / len(engines)
        cost = {
            e.name: scored[e.name][0] + hot_cost(e, scored[e.name][3], mean_recent, costs) for e in engines
        }
        best = _lowest(allowed, lambda e: cost[e.name], turn)
        capped = tuple(e.name for e in engines if scored[e.name][0] < scored[best.name][0])
    ttft, local, load, compute = scored[best.name]
    estimates = {name: s[0] for name, s in scored.items()}
    return Choice(best.name, policy, ttft, local, load, compute, estimates, capped)
