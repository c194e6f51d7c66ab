"""Prometheus metrics under vLLM's names, in a registry of the engine's own (not the global one).

Counters are exposed with the `_total` suffix prometheus_client adds (as vLLM's are), e.g.
`vllm:prefix_cache_hits_total`; a Prometheus parser reports the family as `vllm:prefix_cache_hits`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# 1-2-5 token counts up to 1M, as vLLM's token histograms (build_1_2_5_buckets up to max_model_len)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that started generating."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.request_success = counter("vllm:request_success", "Finished requests.")
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.")
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token (the prefill phase)."
        )
        # observed with the prefill time, for the same requests: the dashboard's cost of a computed token
        # pairs them (vLLM observes the three when a request finishes, this engine at its first token)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request (at its first token).", labels,
            buckets=_TOKEN_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.request_prefill_kv_computed_tokens = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens a request computed: neither in the prefix cache nor loaded from the KV store.",
            labels, buckets=_TOKEN_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens."
        )
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    def update_scheduler_state(
        self, running: int, waiting: int, usage: float, queries: int, hits: int, preemptions: int
    ) -> None:
        """Gauges take the current values; counters take the growth of the engine's running totals."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage_perc.set(usage)
        self.prefix_cache_queries.inc(queries - self._last_queries)
        self.prefix_cache_hits.inc(hits - self._last_hits)
        self.num_preemptions.inc(preemptions - self._last_preemptions)
        self._last_queries, self._last_hits, self._last_preemptions = queries, hits, preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)
