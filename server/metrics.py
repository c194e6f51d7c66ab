"""The server's own Prometheus metrics, kept in their own registry next to the store's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 100 µs (a small HEAD) to 10 s (a large batch over a slow link).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_MISS_OPS = frozenset({"get", "head", "delete"})  # a 404 there is a cache miss, not an error


class ServerMetrics:
    """Request latency per operation, requests by operation and status, bytes in and out."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_seconds = Histogram(
            "kvstore_request_seconds",
            "Time to serve an HTTP request, by operation",
            ["op"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvstore_http_requests",
            "HTTP requests by operation and status",
            ["op", "status"],
            registry=self.registry,
        )
        self.bytes_in = Counter(
            "kvstore_http_received_bytes",
            "Request body bytes received, by operation",
            ["op"],
            registry=self.registry,
        )
        self.bytes_out = Counter(
            "kvstore_http_sent_bytes",
            "Response body bytes sent, by operation",
            ["op"],
            registry=self.registry,
        )
        self.totals: dict[str, int] = {"requests": 0, "errors": 0}  # cheap totals for the history sampler
        self._children: dict[tuple[str, int], tuple] = {}
        self.in_flight = 0  # requests inside the handlers now; graceful shutdown waits for 0
        Gauge(
            "kvstore_http_in_flight_requests", "Requests being served", registry=self.registry
        ).set_function(lambda: self.in_flight)
        self.connections = lambda: 0  # the runner points it at the server's open connections
        Gauge("kvstore_http_connections", "Open client connections", registry=self.registry).set_function(
            lambda: self.connections()
        )
        self.body_bytes = lambda: 0  # the request-body budget in use (server/budget.py)
        Gauge(
            "kvstore_http_body_bytes_in_flight",
            "Request body bytes received or being stored",
            registry=self.registry,
        ).set_function(lambda: self.body_bytes())
        self.refused_connections = Counter(
            "kvstore_http_refused_connections",
            "Connections refused over max_connections",
            registry=self.registry,
        )
        self.reported_gets = Counter(
            "kvstore_reported_gets",
            "Gets same-host clients report they served from the arena index (TOUCH; not measured here)",
            ["op"],
            registry=self.registry,
        )
        self.reported_seconds = Histogram(
            "kvstore_reported_get_seconds",
            "Time clients report for the gets they served from the arena index (at most since their HELLO)",
            ["op"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        lookups = Counter(
            "kvstore_prefix_lookups",
            "Prefix lookups (POST /v1/lookup, data-plane LOOKUP), by whether a missing key cut them short",
            ["result"],
            registry=self.registry,
        )
        self._lookups = {cut: lookups.labels("cut_short" if cut else "whole") for cut in (False, True)}
        self.header_timeouts = Counter(
            "kvstore_http_header_timeouts",
            "Connections closed: headers slower than header_timeout",
            registry=self.registry,
        )

    def count_lookup(self, found: int, asked: int) -> None:
        """A prefix lookup that found `found` of its `asked` leading keys (thread-safe)."""
        self._lookups[found < asked].inc()

    def totals_now(self) -> dict[str, float]:
        """The history sampler's totals: requests, errors, and prefix lookups (all, cut short)."""

        def count(result: str) -> float:
            return self.registry.get_sample_value("kvstore_prefix_lookups_total", {"result": result}) or 0.0

        cut = count("cut_short")
        return {**self.totals, "lookups": count("whole") + cut, "lookups_cut_short": cut}

    def observe_reported(self, op: str, seconds: float) -> None:
        """A get a same-host client says it served itself from the arena index (TOUCH): a claim the
        server cannot measure, so it is counted apart from the requests it served."""
        self.reported_gets.labels(op).inc()
        self.reported_seconds.labels(op).observe(seconds)

    def observe(self, op: str, status: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        children = self._children.get((op, status))
        if children is None:  # labels() costs a lock and a dict walk per call: resolve each pair once
            children = self._children[(op, status)] = (
                self.request_seconds.labels(op), self.requests.labels(op, str(status)),
                self.bytes_in.labels(op), self.bytes_out.labels(op),
            )  # fmt: skip
        seconds_h, count, received, sent = children
        seconds_h.observe(seconds)
        count.inc()
        if bytes_in:
            received.inc(bytes_in)
        if bytes_out:
            sent.inc(bytes_out)
        self.totals["requests"] += 1
        if status >= 400 and not (status == 404 and op in _MISS_OPS):
            self.totals["errors"] += 1

    def render(self, *registries: CollectorRegistry | None) -> bytes:
        """Prometheus text of the given registries (the store's) followed by the server's own."""
        parts = [generate_latest(r) for r in registries if r is not None]
        parts.append(generate_latest(self.registry))
        return b"".join(parts)
