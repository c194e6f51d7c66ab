"""`kvstore_router_*`: decisions per policy and engine, predicted vs actual TTFT, where prompt tokens
came from (local cache, the store, computed), per-engine load and the calibrated costs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.router.scoring import Choice, Costs

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self) -> None:
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
            ["source"],
            registry=r,
        )
        self.predicted = Histogram(
            "kvstore_router_predicted_ttft_seconds", "The chosen engine's estimated TTFT", buckets=_TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.actual = Histogram(
            "kvstore_router_actual_ttft_seconds", "Router arrival to the first streamed bytes (stream: true)",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.error = Histogram(
            "kvstore_router_ttft_error_seconds", "Actual minus predicted TTFT (streamed requests)",
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
        self.cost = Gauge(
            "kvstore_router_cost_seconds", "Calibrated costs (per token for prefill and load, per request for step)",
            ["kind"], registry=r,
        )  # fmt: skip

    def decided(self, choice: Choice) -> None:
        self.decisions.labels(choice.policy, choice.engine).inc()
        self.tokens.labels("local").inc(choice.local_tokens)
        self.tokens.labels("remote").inc(choice.store_tokens)
        self.tokens.labels("miss").inc(choice.compute_tokens)
        self.predicted.observe(choice.predicted_ttft_s)

    def first_token(self, choice: Choice, actual_s: float) -> None:
        self.actual.observe(actual_s)
        self.error.observe(actual_s - choice.predicted_ttft_s)

    def set_costs(self, costs: Costs) -> None:
        self.cost.labels("prefill_per_token").set(costs.prefill_s_per_token)
        self.cost.labels("load_per_token").set(costs.load_s_per_token)
        self.cost.labels("step_per_request").set(costs.step_s_per_request)

    def render(self) -> bytes:
        return generate_latest(self.registry)
