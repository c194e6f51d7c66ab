"""The connector counts each chunk miss with the reason the store gave: evicted and expired apart."""

from __future__ import annotations

from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread, open_store

from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from tests.connectors.sim import Req, make_config, prompt


def test_connector_tells_evicted_from_expired(engines) -> None:
    # ~400 KB per 256-token chunk in the sim layout; 1 MiB of cpu holds two of them
    clock = ManualClock()  # the server's: its TTL is stepped past, not slept through
    store_config, config = StoreConfig(tiers=["cpu"], cpu_capacity="1MiB", ttl=1.5), ServerConfig(port=0)
    with ServerThread(open_store(store_config, config, clock), store_config, config, close_store=True) as srv:
        config = make_config(store_url=srv.server.url)
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
        clock.advance(1.6)  # past the TTL
        assert b.admit(Req("q2", second)) == 0
        assert misses("expired") == 2 and misses("not_stored") == 0
