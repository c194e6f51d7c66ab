"""The connector counts each chunk miss with the reason the store gave: evicted and expired apart."""

from __future__ import annotations

import time

from tests.connectors.conftest import ServerProcess
from tests.connectors.sim import Req, make_config, prompt


def test_connector_tells_evicted_from_expired(engines) -> None:
    # ~400 KB per 256-token chunk in the sim layout; 1 MiB of cpu holds two of them
    server = ServerProcess("--tiers", "cpu", "--cpu-capacity", "1MiB", "--ttl", "1.5").start()
    try:
        config = make_config(store_url=server.url)
        a, b = engines(config, seed=1), engines(config, seed=2)
        first, second = prompt(600, seed=11), prompt(600, seed=12)
        a.prefill(Req("r1", first))  # 2 full chunks stored
        a.worker.flush()
        a.prefill(Req("r2", second))  # 2 more: the first prompt's chunks are evicted
        a.worker.flush()

        def misses(reason: str) -> float:  # since the saves (the engines share one store handle)
            name = f"kvstore_connector_chunk_misses_total{{reason={reason}}}"
            return b.scheduler.metrics.snapshot()[name] - before[name]

        before = b.scheduler.metrics.snapshot()

        assert b.admit(Req("q1", first)) == 0
        assert misses("evicted") == 2 and misses("expired") == 0
        time.sleep(1.6)
        assert b.admit(Req("q2", second)) == 0
        assert misses("expired") == 2 and misses("not_stored") == 0
    finally:
        server.stop()
