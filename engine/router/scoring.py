"""Where a request should go: one pure function over the engines' state (no I/O, no clock), used by
`kvstore-engine router` and by the fleet simulator in benchmarks/ alike.

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
`ttft` (the lowest estimate among engines under the share cap: an engine that took more than
`max_share` times its fair share of the recent decisions is passed over while another can serve).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("round_robin", "least_loaded", "prefix", "ttft")


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
    recent: int = 0  # decisions for it among the router's recent ones (the share cap)


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
    capped: tuple[str, ...] = ()  # engines the share cap passed over (ttft)


def estimate(engine: EngineState, request: Request, costs: Costs) -> tuple[float, int, int, int]:
    """(estimated TTFT s, local tokens, store tokens, compute tokens) of `request` on `engine`."""
    n = request.prompt_tokens
    local = min(engine.local_tokens, n - 1)
    reused = max(local, min(request.store_tokens, n - 1))
    load, compute = reused - local, n - reused
    queue = engine.waiting_tokens * costs.prefill_s_per_token + engine.in_flight * costs.step_s_per_request
    ttft = costs.base_s + queue + load * costs.load_s_per_token + compute * costs.prefill_s_per_token
    return ttft, local, load, compute


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
    max_share: float = 1.2,
    turn: int = 0,
) -> Choice:
    """The engine `policy` picks for `request`. `turn` is the caller's count of its decisions:
    round_robin's counter, and the draw that breaks ties between equal engines."""
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
        allowed = under_cap(engines, max_share)
        ok = {e.name for e in allowed}
        capped = tuple(e.name for e in engines if e.name not in ok)
        best = _lowest(allowed, lambda e: scored[e.name][0], turn)
    ttft, local, load, compute = scored[best.name]
    estimates = {name: s[0] for name, s in scored.items()}
    return Choice(best.name, policy, ttft, local, load, compute, estimates, capped)
