"""The engines' side of the dashboard: their Prometheus `/metrics`, read by the server's sampler.

`kvstore-server --engine-metrics http://engine:8000` (repeatable) makes the server read each engine's
metrics (vLLM's names, which kvstore-engine exports too) every sample, so the dashboard's funnel starts
at the engine: prompt tokens -> the engine's own prefix cache -> this store -> recompute. An engine
that does not answer within the timeout counts as down for that sample; it never delays the store.

Two clocks: the funnel's token counters grow when a request is admitted (its prefix lookups), the
prefill histograms when its prefill is over (vLLM: when it finishes; kvstore-engine: at its first
token). `prefill_seconds`, `prefills`, `prefill_prompt_tokens` and `prefill_computed_tokens` are
observed together, for the same requests, so the cost of a computed token is their ratio, never
seconds of one request over tokens of another (issue 43: 22.4 ms "per computed token" where a cold
prefill cost 1.4). A sample keeps each engine's own fields too (`by_url`), so that a prefill can be
told apart by the engine that ran it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# sample name -> the field it adds to, summed over engines
COUNTERS = {
    "vllm:prefix_cache_queries_total": "prompt_tokens",  # every prompt token is looked up locally first
    "vllm:prefix_cache_hits_total": "engine_hit_tokens",
    "vllm:external_prefix_cache_queries_total": "store_query_tokens",
    "vllm:external_prefix_cache_hits_total": "store_hit_tokens",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_time_seconds_count": "prefills",
    # the same prefills' tokens: all of their prompts, and those neither engine nor store had
    "vllm:request_prompt_tokens_sum": "prefill_prompt_tokens",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_computed_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}
ENGINE_FIELDS = (*dict.fromkeys(COUNTERS.values()), "engines_up", "engines")
# what a sample keeps of each engine on its own (the page tells prefills apart by engine with them)
PER_ENGINE = ("store_hit_tokens", "prefill_seconds", "prefills", "prefill_prompt_tokens",
              "prefill_computed_tokens", "running", "waiting")  # fmt: skip


def metrics_url(url: str) -> str:
    """An engine's base URL or its metrics URL -> its metrics URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


# absent from an engine that does not export them (kvstore-engine before issue 43): left out of its
# fields then, not 0, so that the page knows its prefills' computed tokens are unknown
OPTIONAL = frozenset({"prefill_prompt_tokens", "prefill_computed_tokens"})


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The funnel's fields from one engine's Prometheus text (absent metrics count as 0, but OPTIONAL's
    are left out)."""
    out = {f: 0.0 for f in COUNTERS.values() if f not in OPTIONAL}
    misses: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            field = COUNTERS.get(s.name)
            if field is not None:
                out[field] = out.get(field, 0.0) + s.value
            elif s.name == "kvstore_connector_chunk_misses_total" and "reason" in s.labels:
                misses[s.labels["reason"]] = misses.get(s.labels["reason"], 0.0) + s.value
    out.update({f"chunk_misses_{r}": v for r, v in misses.items()})
    return out


class EngineScraper:
    def __init__(self, urls: Sequence[str], timeout: float = 2.0) -> None:
        self.urls = [metrics_url(u) for u in urls]
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._warned: set[str] = set()

    async def _one(self, session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                parsed = parse_engine_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            if url not in self._warned:
                log.warning("engine metrics at %s: %s (the dashboard counts that engine as down)", url, e)
                self._warned.add(url)
            return None
        self._warned.discard(url)
        return parsed

    async def scrape(self) -> dict[str, Any] | None:
        """The sum over every engine that answered, plus `engines_up` / `engines`, and `by_url`: each
        engine's own PER_ENGINE fields by its metrics URL (None when it did not answer); None without
        engines."""
        if not self.urls:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        results = await asyncio.gather(*(self._one(self._session, u) for u in self.urls))
        total: dict[str, Any] = dict.fromkeys(COUNTERS.values(), 0.0)
        for r in results:
            for k, v in (r or {}).items():
                total[k] = total.get(k, 0.0) + v
        total["engines_up"] = sum(r is not None for r in results)
        total["engines"] = len(self.urls)
        total["by_url"] = {
            url: None if r is None else {k: r[k] for k in PER_ENGINE if k in r}
            for url, r in zip(self.urls, results, strict=True)
        }
        return total

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
