"""Two kvstore-servers sharing one 3+3 Valkey Cluster (their redis tier, one prefix): a blob put
through server 1 is a hit through server 2, bit for bit; SmolLM2 on server 1 computes a 1,030-token
prompt and a new engine on server 2 loads its chunks through the Cluster, token-identical to a cold
run; and the cross-server rule for deletes and replaces (README, "The fleet")."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvstore.sdk.remote import RemoteBackend
from prometheus_client.parser import text_string_to_metric_families
from redis.crc import key_slot

from kvstore.blob import encode_blob
from tests.blobs import kept
from tests.connectors.conftest import ServerProcess
from tests.connectors.engine_util import doc, generate, llm, store_metrics
from tests.fleet.conftest import fleet_servers, keys_by_slot
from tests.server import test_dashboard as dashboard
from tests.valkey import ValkeyCluster, wait_until

chromium = dashboard.chromium  # the fixture (Debian's chromium, installed where missing)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"fleet{uuid.uuid4().hex[:6]}:"


@pytest.fixture(scope="module")
def servers(
    cluster33: ValkeyCluster, prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    """Two servers, tiers cpu + redis, the same Cluster and prefix (one shared namespace)."""
    with fleet_servers(
        cluster33, prefix, tmp_path_factory, "--tiers", "cpu,redis", "--cpu-capacity", "256MiB",
        "--sample-interval", "0.3",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture
def clients(servers: list[ServerProcess]) -> Iterator[list[RemoteBackend]]:
    made = [RemoteBackend(s.url, read_index=False) for s in servers]
    yield made
    for c in made:
        c.close()


HITS = "vllm:external_prefix_cache_hits_total"


def blob(seed: int, tokens: int = 256, key: str | None = None) -> bytes:
    """A real KV blob (64 KiB at 256 tokens), different for each seed; bound to `key` when given (the
    store keeps it, and serves it, as it is), else kept bound to the key it is put under (kept)."""
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 4, tokens, 2, 16, generator=g).half(), key=key)


def tier_stat(client: RemoteBackend, tier: str, field: str) -> int:
    return next(int(t[field]) for t in client.stats()["tiers"] if t["name"] == tier)


def tier_hits(client: RemoteBackend, tier: str) -> int:
    return tier_stat(client, tier, "hits")


def _last_sample(url: str) -> float:
    """When the server at `url` took its last dashboard sample (0: none yet)."""
    with urllib.request.urlopen(url + "/v1/stats/history", timeout=10) as r:
        samples = json.load(r)["samples"]
    return samples[-1]["t"] if samples else 0.0


def test_a_blob_put_through_one_server_hits_through_the_other(clients: list[RemoteBackend]) -> None:
    one, two = clients
    blobs = {k: blob(i, 200 + i, key=k) for i, k in enumerate(uuid.uuid4().hex for _ in range(20))}
    written, read = tier_stat(one, "redis", "written_bytes"), tier_stat(two, "redis", "read_bytes")
    for k, b in blobs.items():
        assert "redis" in one.put_blob(k, b)  # write-through: the 201 names the shared tier
    size = sum(len(b) for b in blobs.values())
    assert tier_stat(one, "redis", "written_bytes") - written == size  # server 1's metrics: written
    before = tier_hits(two, "redis")
    assert [bytes(x) for x in two.batch_get(list(blobs))] == list(blobs.values())  # bit-exact
    assert tier_hits(two, "redis") - before == len(blobs)  # from the Cluster, not a local tier
    assert tier_stat(two, "redis", "read_bytes") - read == size  # server 2's metrics: read there
    assert all(bytes(two.get_blob(k)) == b for k, b in blobs.items())  # now from server 2's cpu


def test_delete_and_replace_across_servers(clients: list[RemoteBackend]) -> None:
    """The rule: each server's own tiers (cpu, disk) are caches of the Cluster that nobody else
    invalidates. A replace or delete through server 1 reaches the Cluster and server 1's tiers;
    server 2 serves what it holds locally (a complete blob once written for that key) until it evicts
    it or is told too. A key server 2 does not hold locally is read from the Cluster: the latest."""
    one, two = clients
    held, not_held = uuid.uuid4().hex, uuid.uuid4().hex
    v1, v2 = blob(100), blob(101)  # bound to no key: each server keeps them bound to their key
    one.put_blob(held, v1)
    one.put_blob(not_held, v1)
    assert bytes(two.get_blob(held)) == kept(v1, held)  # server 2 now holds `held` in its cpu tier
    one.put_blob(held, v2)
    one.put_blob(not_held, v2)
    assert bytes(one.get_blob(held)) == kept(v2, held) and bytes(two.get_blob(not_held)) == kept(v2, not_held)
    assert bytes(two.get_blob(held)) == kept(v1, held)  # its own copy: not the latest, never torn or foreign
    assert one.delete(held) and one.get_blob(held) is None
    assert bytes(two.get_blob(held)) == kept(v1, held)  # still local on server 2
    assert two.delete(held)  # a fleet-wide delete is a delete on every server that may hold it
    assert two.get_blob(held) is None and one.get_blob(held) is None


def tier_row(dom: str, tier: str) -> list[str]:
    """The cells of `tier`'s row in the dashboard's tier table."""
    row = re.search(rf"<tr><td>{tier}</td>(.*?)</tr>", dom)
    assert row, dom[:3000]
    return re.findall(r"<td>([^<]*)</td>", row.group(1))


def test_the_dashboards_show_the_shared_tier(
    clients: list[RemoteBackend], chromium: str, tmp_path: Path
) -> None:
    """Server 1's dashboard shows the bytes its puts wrote to the shared tier, server 2's the reads it
    served from there (the funnel's "store: redis" and the tier table). Which server wrote a blob is
    not recorded (README, "The fleet")."""
    one, two = clients
    blobs = {k: blob(300 + i, key=k) for i, k in enumerate(uuid.uuid4().hex for _ in range(4))}
    for k, b in blobs.items():
        one.put_blob(k, b)
    assert [bytes(x) for x in two.batch_get(list(blobs))] == list(blobs.values())
    taken = [_last_sample(c.url) for c in clients]  # a sample after it on each server
    wait_until(lambda: all(_last_sample(c.url) > t for c, t in zip(clients, taken, strict=True)))
    doms = []
    for i, c in enumerate(clients):
        run = dashboard._run_chromium(chromium, tmp_path / f"profile{i}", f"{c.url}/dashboard", "--dump-dom")
        assert run.returncode == 0, run.stderr[-2000:]
        doms.append(run.stdout)
    heads = re.search(r'<table id="tiers"><thead><tr>(.*?)</tr>', doms[0]).group(1)
    cols = re.findall(r"<th>([^<]*)</th>", heads)[1:]
    first, second = ({c: v for c, v in zip(cols, tier_row(d, "redis"), strict=True)} for d in doms)
    assert first["written"] not in ("0 B", "") and second["hits"] not in ("0", "")
    assert second["read"] not in ("0 B", "")
    assert dashboard._stages(doms[1], "funnel")["store: redis"] >= len(blobs)


def metrics(client: RemoteBackend) -> dict[tuple[str, tuple], float]:
    """The server's /metrics: (sample name, sorted labels) -> value."""
    text = bytes(client.http.request("GET", "/metrics").body).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def cluster_counter(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted({"tier": "redis", **labels}.items()))), 0.0)


def test_redirects_reach_both_servers_metrics(
    clients: list[RemoteBackend], cluster33: ValkeyCluster, prefix: str
) -> None:
    """A reshard while both servers read and write: server 2's gets of a half-moved slot and server 1's
    puts into it are ASKed (followed, hits), server 1's first put after the move is MOVED (the map
    updated and refreshed); all of it in each server's /metrics, none of it an error."""
    one, two = clients
    owners = cluster33.slot_owners()
    src, dst = cluster33.primaries()[:2]
    slots = keys_by_slot(prefix, src, owners, n_slots=2, per_slot=3)
    blobs = {k: blob(200 + i, 16, key=k) for i, k in enumerate(k for ks in slots.values() for k in ks)}
    for k, b in blobs.items():
        one.put_blob(k, b)
    before = [metrics(c) for c in clients]

    def half_moved(slot: int) -> None:
        assert [bytes(two.get_blob(k)) for k in slots[slot]] == [blobs[k] for k in slots[slot]]
        new = uuid.uuid4().hex  # absent on the source: the put is ASKed to the target
        while key_slot((prefix + new).encode()) != slot:
            new = uuid.uuid4().hex
        one.put_blob(new, blob(slot, 16, key=new))
        assert bytes(two.get_blob(new)) == blob(slot, 16, key=new)

    assert cluster33.migrate_slots(list(slots), src, dst, between=half_moved) >= 6
    wait_until(lambda: all(cluster33.slot_owners()[s] is dst for s in slots), timeout=10)
    after_move = uuid.uuid4().hex
    while key_slot((prefix + after_move).encode()) not in slots:
        after_move = uuid.uuid4().hex
    one.put_blob(after_move, blob(7, 16, key=after_move))  # server 1's map still says src: MOVED, followed
    assert bytes(two.get_blob(after_move)) == blob(7, 16, key=after_move)
    refreshes = "kvstore_cluster_map_refreshes_total"
    wait_until(lambda: cluster_counter(metrics(one), refreshes) > cluster_counter(before[0], refreshes))
    after = [metrics(c) for c in clients]
    redirects = "kvstore_cluster_redirects_total"
    for b, a in zip(before, after, strict=True):
        assert cluster_counter(a, redirects, kind="ask") > cluster_counter(b, redirects, kind="ask")
        assert cluster_counter(a, "kvstore_tier_errors_total") == cluster_counter(
            b, "kvstore_tier_errors_total"
        )
    assert cluster_counter(after[0], redirects, kind="moved") > cluster_counter(
        before[0], redirects, kind="moved"
    )
    assert ("kvstore_tier_fast_fails_total", (("tier", "redis"),)) in after[1]  # exported, at zero


@pytest.mark.slow
def test_engine_on_server_2_reuses_what_engine_on_server_1_computed(clients: list[RemoteBackend]) -> None:
    """Engine A (server 1) computes a 1,030-token prompt; a new engine B on server 2 loads its 4 full
    chunks from the Cluster (server 2's redis tier), token-identical to a cold engine."""
    one, two = clients
    prompt = doc(1030, 3100 + uuid.uuid4().int % 1000)  # a topic no other test stored
    long = {"max_model_len": 1100}
    cold = llm(**long)
    try:
        want = generate(cold, [prompt])
    finally:
        cold.shutdown()
    urls = [c.url for c in clients]
    a = llm(kv_backend="kvstore", kv_store_url=urls[0], **long)
    try:
        assert generate(a, [prompt]) == want
        assert store_metrics(a)["kvstore_connector_saved_chunks_total"] >= 4
    finally:
        a.shutdown()
    before = tier_hits(two, "redis")
    b = llm(kv_backend="kvstore", kv_store_url=urls[1], **long)
    try:
        start = store_metrics(b)
        assert generate(b, [prompt]) == want
        end = store_metrics(b)
    finally:
        b.shutdown()
    assert end[HITS] - start[HITS] == 1024  # every full chunk below the last prompt token
    assert tier_hits(two, "redis") - before >= 4  # they came through the Cluster
