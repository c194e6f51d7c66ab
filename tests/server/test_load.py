"""The load test in short: 8 client processes for ~10 s against a fixed-capacity cpu tier over valkey,
beside hostile clients (slow headers, idle sockets, oversized puts, a Redis that hangs)."""

from __future__ import annotations

import pytest

from benchmarks.load_server import HIT, MISS, PUT, find_lost, run_load

MiB = 2**20


def test_find_lost_tells_eviction_from_loss():
    k, other = "a" * 32, "b" * 32
    put, miss = (1.1, k, MiB, PUT, 1.0), (3.1, k, 0, MISS, 3.0)  # (end, key, bytes, kind, start)
    assert find_lost([[put, miss]], capacity=8 * MiB)  # nothing else touched: lost
    traffic = [(2.1 + i / 100, other, MiB, PUT if i % 2 else HIT, 2.0) for i in range(8)]
    assert not find_lost([[put, miss], traffic], capacity=8 * MiB)  # 8 MiB touched: evicted
    assert find_lost([[put, miss], traffic[:6]], capacity=8 * MiB)  # 6 MiB cannot evict it
    assert not find_lost([[(3.0, k, 0, MISS, 2.9)]], capacity=8 * MiB)  # never written: a plain miss


def test_find_lost_counts_a_put_that_overlaps_the_window():
    """A big put that started before the key's put but ended after it may have been stored after it
    (and evicted it): that is not a lost write. One that ended before the key's put started is."""
    k, big = "a" * 32, "f" * 32
    put, miss = (2.0, k, MiB, PUT, 1.9), (3.1, k, 0, MISS, 3.0)
    assert not find_lost([[put, miss], [(2.5, big, 8 * MiB, PUT, 1.0)]], capacity=8 * MiB)
    assert find_lost([[put, miss], [(1.5, big, 8 * MiB, PUT, 1.0)]], capacity=8 * MiB)
    assert find_lost([[put, miss], [(3.5, big, 8 * MiB, PUT, 3.2)]], capacity=8 * MiB)  # after the miss


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
