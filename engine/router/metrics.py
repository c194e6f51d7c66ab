"""`kvstore_router_*`: decisions per policy and engine, predicted vs actual TTFT, where prompt tokens
came from (local cache, the store, computed), per-engine load and the calibrated costs; and, for the
dashboard (`/v1/router/state`), each engine's totals and the p50s of its recent TTFTs."""

from __future__ import annotations

import collections
import statistics
from typing import Any

from kvstore.engine.router.scoring import POLICIES, Choice, Costs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SOURCES = ("local", "remote", "miss")  # the engine's cache, loaded from the store, computed
RECENT = 256  # TTFTs per engine the dashboard's p50s are over


class EngineTally:
    """One engine's figures for the dashboard: totals since start, the recent TTFTs."""

    def __init__(self) -> None:
        self.decisions: collections.Counter[str] = collections.Counter()  # per policy
        self.tokens = dict.fromkeys(SOURCES, 0)
        self.capped = 0
        self.errors = 0  # requests it answered with an error status (not in decisions nor tokens)
        self.predicted: collections.deque[float] = collections.deque(maxlen=RECENT)  # every decision
        self.actual: collections.deque[float] = collections.deque(maxlen=RECENT)  # streamed requests

    def summary(self, total_decisions: int) -> dict[str, Any]:
        n = sum(self.decisions.values())
        return {
            "decisions": dict(self.decisions),
            "share": n / total_decisions if total_decisions else 0.0,
            "tokens": dict(self.tokens),
            "capped": self.capped,
            "errors": self.errors,
            "predicted_ttft_p50_s": statistics.median(self.predicted) if self.predicted else None,
            "actual_ttft_p50_s": statistics.median(self.actual) if self.actual else None,
            "ttft_samples": len(self.actual),
        }


class RouterMetrics:
    def __init__(self, engines: list[str], policy: str) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvstore_router_decisions",
            "Requests routed, by policy and engine",
            ["policy", "engine"],
            registry=r,
        )
        self.tokens = Counter(
            "kvstore_router_prompt_tokens",
            "Prompt tokens of routed requests by where the choice expects them from: local (the engine's "
            "cache), remote (loaded from the store), miss (computed)",
            ["policy", "engine", "source"],
            registry=r,
        )
        self.engine_errors = Counter(
            "kvstore_router_engine_errors",
            "Requests the engine answered with an error status (4xx, 5xx): not counted as routed",
            ["engine", "code"],
            registry=r,
        )
        self.capped = Counter(
            "kvstore_router_capped",
            "Decisions (ttft) in which this engine had a lower estimated TTFT than the engine chosen and was "
            "passed over as hot: by the hot-spot cost, or the --max-share cap when one is set",
            ["engine"],
            registry=r,
        )
        self.predicted = Histogram(
            "kvstore_router_predicted_ttft_seconds", "The chosen engine's estimated TTFT", ["engine"],
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.actual = Histogram(
            "kvstore_router_actual_ttft_seconds", "Router arrival to the first streamed bytes (stream: true)",
            ["engine"], buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.error = Histogram(
            "kvstore_router_ttft_error_seconds", "Actual minus predicted TTFT (streamed requests)", ["engine"],
            buckets=(-5, -1, -0.25, -0.05, 0, 0.05, 0.25, 1, 5), registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "kvstore_router_engine_in_flight", "Requests in flight", ["engine"], registry=r
        )
        self.waiting = Gauge(
            "kvstore_router_engine_waiting_tokens",
            "Prompt tokens sent and not yet prefilled",
            ["engine"],
            registry=r,
        )
        self.up = Gauge(
            "kvstore_router_engine_up",
            "0 while the engine is passed over (it refused a connection, began no answer within "
            "--first-byte-timeout, or its health probe went unanswered), else 1",
            ["engine"],
            registry=r,
        )
        self.cost = Gauge(
            "kvstore_router_cost_seconds", "Calibrated costs (per token for prefill and load, per request for step)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.policy = Gauge(
            "kvstore_router_policy",
            "1 for the policy in use (--policy), 0 for the others",
            ["policy"],
            registry=r,
        )
        for p in POLICIES:
            self.policy.labels(p).set(1 if p == policy else 0)
        self.tallies = {u: EngineTally() for u in engines}

    def decided(self, choice: Choice) -> None:
        """A routed request: its engine accepted it (a status below 400)."""
        self.decisions.labels(choice.policy, choice.engine).inc()
        split = zip(SOURCES, (choice.local_tokens, choice.store_tokens, choice.compute_tokens), strict=True)
        tally = self.tallies[choice.engine]
        for source, n in split:
            self.tokens.labels(choice.policy, choice.engine, source).inc(n)
            tally.tokens[source] += n
        self.predicted.labels(choice.engine).observe(choice.predicted_ttft_s)
        tally.decisions[choice.policy] += 1
        tally.predicted.append(choice.predicted_ttft_s)
        for engine in choice.capped:
            self.capped.labels(engine).inc()
            self.tallies[engine].capped += 1

    def engine_error(self, engine: str, status: int) -> None:
        self.engine_errors.labels(engine, str(status)).inc()
        self.tallies[engine].errors += 1

    def first_token(self, choice: Choice, actual_s: float) -> None:
        self.actual.labels(choice.engine).observe(actual_s)
        self.error.labels(choice.engine).observe(actual_s - choice.predicted_ttft_s)
        self.tallies[choice.engine].actual.append(actual_s)

    def set_load(self, engine: str, in_flight: int, waiting_tokens: int, up: bool) -> None:
        self.in_flight.labels(engine).set(in_flight)
        self.waiting.labels(engine).set(waiting_tokens)
        self.up.labels(engine).set(1 if up else 0)

    def set_costs(self, costs: Costs) -> None:
        self.cost.labels("prefill_per_token").set(costs.prefill_s_per_token)
        self.cost.labels("load_per_token").set(costs.load_s_per_token)
        self.cost.labels("step_per_request").set(costs.step_s_per_request)

    def summary(self, engine: str) -> dict[str, Any]:
        """`engine`'s dashboard figures (decisions and tokens since start, p50s of recent TTFTs)."""
        total = sum(sum(t.decisions.values()) for t in self.tallies.values())
        return self.tallies[engine].summary(total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
