"""The scoring costs, calibrated from the engines' own Prometheus metrics (vLLM's names, which
kvstore-engine exports too), read every few seconds:

- prefill s/token = growth of `vllm:request_prefill_time_seconds_sum` minus the time spent loading
  (`kvstore_connector_load_seconds_sum`), over the prompt tokens computed (`vllm:prompt_tokens_total`
  minus `vllm:prefix_cache_hits_total` and `vllm:external_prefix_cache_hits_total`);
- load s/token = growth of `kvstore_connector_load_seconds_sum` over `kvstore_connector_loaded_tokens_total`;
- step s/request = growth of `vllm:inter_token_latency_seconds_sum` over its `_count`: the time one
  decode step takes under the engines' load at the time (engines sharing CPUs step slower when more of
  them are busy), what each request in flight adds to a new one's wait;

each an exponentially weighted average over the engines and scrapes, updated only when a scrape saw
enough tokens (steps) to mean something; a cost's first measurement replaces its default outright.
Until then the scoring module's defaults hold.
"""

from __future__ import annotations

import dataclasses

from kvstore.engine.router.scoring import Costs
from prometheus_client.parser import text_string_to_metric_families

_NAMES = {
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:prompt_tokens_total": "prompt",
    "vllm:prefix_cache_hits_total": "local_hits",
    "vllm:external_prefix_cache_hits_total": "store_hits",
    "kvstore_connector_load_seconds_sum": "load_s",
    "kvstore_connector_loaded_tokens_total": "loaded",
    "vllm:inter_token_latency_seconds_sum": "itl_s",
    "vllm:inter_token_latency_seconds_count": "itl_n",
}
MIN_TOKENS = 64  # a scrape with fewer new tokens does not move a cost
MIN_STEPS = 8  # nor one with fewer new decode steps the step cost
ALPHA = 0.3


def parse_totals(text: str) -> dict[str, float]:
    """The counters calibration uses, summed over labels, from a /metrics body."""
    out = dict.fromkeys(_NAMES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = _NAMES.get(s.name)
            if key is not None:
                out[key] += s.value
    return out


class Calibrator:
    def __init__(self, costs: Costs | None = None) -> None:
        self.costs = costs or Costs()
        self._last: dict[str, dict[str, float]] = {}
        self.updates = 0
        self.measured: set[str] = set()  # the costs measured at least once (the rest are defaults)

    def _blend(self, name: str, value: float) -> None:
        old = getattr(self.costs, name)
        new = (1 - ALPHA) * old + ALPHA * value if name in self.measured else value
        self.measured.add(name)
        self.costs = dataclasses.replace(self.costs, **{name: new})

    def observe(self, engine: str, text: str) -> None:
        """One scrape of `engine`'s /metrics."""
        self.observe_totals(engine, parse_totals(text))

    def observe_totals(self, engine: str, now: dict[str, float]) -> None:
        """One scrape of `engine`'s counters, as parse_totals gives them."""
        last = self._last.get(engine)
        self._last[engine] = now
        if last is None or now["prompt"] < last["prompt"]:  # first look, or the engine restarted
            return
        d = {k: now[k] - last[k] for k in now}
        computed = d["prompt"] - d["local_hits"] - d["store_hits"]
        moved = False
        if d["loaded"] >= MIN_TOKENS and d["load_s"] > 0:
            self._blend("load_s_per_token", d["load_s"] / d["loaded"])
            moved = True
        if computed >= MIN_TOKENS and d["prefill_s"] > 0:
            self._blend("prefill_s_per_token", max(d["prefill_s"] - d["load_s"], 0.0) / computed)
            moved = True
        if d["itl_n"] >= MIN_STEPS and d["itl_s"] > 0:
            self._blend("step_s_per_request", d["itl_s"] / d["itl_n"])
            moved = True
        self.updates += moved
