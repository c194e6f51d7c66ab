"""The load test in short: 8 client processes for ~10 s against a fixed-capacity cpu tier over valkey,
beside hostile clients (slow headers, idle sockets, oversized puts, a Redis that hangs)."""

from __future__ import annotations

import pytest

from benchmarks.load_server import HIT, MISS, PUT, find_lost, run_load

MiB = 2**20


def test_find_lost_tells_eviction_from_loss():
    k, other = "a" * 32, "b" * 32
    put, miss = (1.0, k, MiB, PUT), (3.0, k, 0, MISS)
    assert find_lost([[put, miss]], capacity=8 * MiB, slack=MiB)  # nothing else touched: lost
    traffic = [(2.0 + i / 100, other, MiB, PUT if i % 2 else HIT) for i in range(8)]
    assert not find_lost([[put, miss], traffic], capacity=8 * MiB, slack=MiB)  # 8 MiB touched: evicted
    assert not find_lost([[(3.0, k, 0, MISS)]], capacity=8 * MiB, slack=0)  # never written: a plain miss


@pytest.mark.slow
def test_load_8_clients_10s_beside_hostile_clients():
    r = run_load(duration=10, clients=8, capacity=32 * MiB, budget=64 * MiB, hostile=True)
    assert r["errors"] == 0, r["error_samples"]
    assert r["wrong_blobs"] == 0 and r["stale_blobs"] == 0
    assert r["lost_writes"] == 0, r["lost_samples"]
    assert r["acked_puts"] > 100 and r["gets_hit"] > 100
    assert r["evictions"] > 0  # the capacity was really exercised
    assert r["stored_bytes"] <= 32 * MiB
    assert r["rss_within_bound"], (r["rss_idle"], r["rss_max"], r["rss_allowance"])
    assert r["rss_shm_max"] > 0  # the honest clients' blobs went through shared memory, inside the bound
    h = r["hostile_report"]
    assert h["redis_hangs"] >= 1 and h["oversized"].get("201", 0) >= 1
    assert h["slow_closed_408"] == 0  # header_timeout is 10 s: none was due yet, all still held open
