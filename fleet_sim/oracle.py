"""What no router could beat (`kvstore-fleet-sim --oracle`), to measure a configuration's distance from it.

Two references, each printed beside every configuration:

- **the oracle run**: the same trace, engine count and policy, with unbounded memory (every engine's
  KV and a shared store tier that forget nothing) and free transfers (loads and saves take no time, no
  bandwidth, no engine time). What is left between it and the configuration is what memory and the
  network cost; what is left between it and the bound is queueing (where the policy put requests).
- **the bound**: each request alone on an idle engine, prefilling only the prompt tokens that no earlier
  request of the trace had (the leading chunks some earlier request had are free: loaded at no cost,
  as from a store holding everything; the last engine block is computed anyway, for the first token's
  logits, as in the simulated and the real engines), in steps of `max_batched_tokens` at the profile's
  costs, plus the client's hop each way. No schedule can give any request a smaller TTFT, so the
  bound's quantiles are below every configuration's: `p90 / bound` is how far a configuration is from it.
  It does not depend on the engine count or the policy.
"""

from __future__ import annotations

import dataclasses
import math

from kvstore.engine.router.scoring import Costs
from kvstore.fleet_sim.profile import Profile
from kvstore.fleet_sim.sim import ENGINE_BLOCK, SimConfig, _quantile, _tokens
from kvstore.fleet_sim.trace import ChunkKeys, TraceRequest


def free_transfers(profile: Profile) -> Profile:
    """`profile` with loads and saves that take no time: unlimited bandwidth, no latency, no save cost."""
    return dataclasses.replace(
        profile,
        name=f"{profile.name} (free transfers)",
        server_load_bps=math.inf,
        server_aggregate_bps=math.inf,
        valkey_load_bps=math.inf,
        valkey_aggregate_bps=math.inf,
        hop_latency_s=0.0,
        nic_bps=math.inf,
        save_s_per_token=0.0,
    )


def oracle_config(config: SimConfig) -> SimConfig:
    """`config` with unbounded memory (engines' KV and a shared store tier that never evict), and a router
    that knows loads are free."""
    return dataclasses.replace(
        config, store_gib=math.inf, engine_kv_gib=math.inf, router_costs=Costs(load_s_per_token=0.0)
    )


def bound_ttfts(
    trace: list[TraceRequest], profile: Profile, keys: ChunkKeys, client_s: float = 0.0
) -> list[float]:
    """Each request's TTFT alone on an idle engine, prefilling only what no earlier request had."""
    return [t for t, _ in _bound(trace, profile, keys, client_s)]


def _bound(
    trace: list[TraceRequest], profile: Profile, keys: ChunkKeys, client_s: float
) -> list[tuple[float, int]]:
    """(TTFT, prompt tokens not prefilled) of each request under the bound."""
    seen: set[bytes] = set()
    out: list[tuple[float, int]] = []
    for req in trace:
        ks = keys.of(req)
        lead = 0
        while lead < len(ks) and ks[lead] in seen:
            lead += 1
        n = req.input_tokens
        done = reused = min(_tokens(req, lead), (n - 1) // ENGINE_BLOCK * ENGINE_BLOCK)
        t = 0.0
        while done < n:
            step = min(n - done, profile.max_batched_tokens)
            t += profile.prefill_step_s + profile.prefill_s(step, done)
            done += step
        out.append((t + 2 * client_s, reused))
        seen.update(ks)
    return out


def bound_stats(trace: list[TraceRequest], profile: Profile, keys: ChunkKeys, client_s: float = 0.0) -> dict:
    """The bound's TTFT p50/p90/p99 and its prefix reuse (the share of prompt tokens it does not prefill)."""
    per = _bound(trace, profile, keys, client_s)
    ttfts = sorted(t for t, _ in per)
    return {
        "bound_reuse": sum(r for _, r in per) / sum(req.input_tokens for req in trace),
        "bound_p50_s": _quantile(ttfts, 0.5),
        "bound_p90_s": _quantile(ttfts, 0.9),
        "bound_p99_s": _quantile(ttfts, 0.99),
    }
