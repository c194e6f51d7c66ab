"""Round trips to a real kvstore-server per prefix lookup of the connector, counted by the server's own
request counters: one per question (a hit, or a miss with its reason), none for the same question of
the same request again (vLLM asks every step a waiting request is not admitted)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.store_handle import acquire_store, release_store

from kvstore.blob import encode_blob
from tests.connectors.sim import Req

CS, BS = 256, 16
LAYOUT = {"model_name": "m", "model_config_hash": "0" * 32, "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
          "kv_dtype": "bfloat16"}  # fmt: skip
TOKENS = list(range(1000, 1600))  # 2 full chunks + 88 tokens: the cap is 592, inside chunk 2


def requests_served(url: str) -> int:
    """Every request the server answered (any op, any status), but /metrics itself."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    lines = re.findall(r'^kvstore_http_requests_total\{op="([^"]+)",status="\d+"\} (\S+)$', text, re.M)
    return int(sum(float(v) for op, v in lines if op != "metrics"))


@pytest.fixture
def scheduler(shared_server) -> Iterator[tuple[KVStoreScheduler, str]]:
    config = KVTransferConfig(store_url=shared_server.url, chunk_size=CS, block_size=BS, layout=LAYOUT,
                              namespace="round-trips")  # fmt: skip
    handle = acquire_store(config)
    try:
        yield KVStoreScheduler(config, handle), shared_server.url
    finally:
        release_store(handle)


def test_one_round_trip_per_lookup_and_none_for_the_same_question(scheduler) -> None:
    sched, url = scheduler
    stored = Req("stored", list(TOKENS))
    keys = sched._chunk_keys(stored)
    (partial,) = keys.partial_keys(TOKENS, 2, [80])  # chunk 2's first 80 tokens: 512 + 80 = the cap
    blob = encode_blob(torch.zeros(2, 2, CS, 1, 8, dtype=torch.bfloat16))
    sched.handle.batch_put_blobs([(keys.keys[0], blob), (keys.keys[1], blob), (partial, blob)])

    sched.get_num_new_matched_tokens(Req("warm", [1, 2, 3] * 200), 0)  # the lookup client connects
    hit = Req("hit", list(TOKENS))
    before = requests_served(url)
    assert sched.get_num_new_matched_tokens(hit, 0) == (592, True)  # 2 full chunks + the partial
    assert requests_served(url) - before == 1
    before = requests_served(url)
    assert sched.get_num_new_matched_tokens(hit, 0) == (592, True)  # not admitted; asked again
    assert requests_served(url) - before == 0

    # a miss of chunk 1 (another second chunk) with partial candidates: the reason comes in the answer
    other = Req("miss", TOKENS[:256] + [7] * 344)
    before = requests_served(url)
    assert sched.get_num_new_matched_tokens(other, 0) == (256, True)
    assert requests_served(url) - before == 1
    assert sched._lookups["miss"].miss_reason == "not_stored"

    # the cache answers the same question only: a longer request (a new token) asks again, once
    hit.all_token_ids.append(5)
    before = requests_served(url)
    sched.get_num_new_matched_tokens(hit, 0)
    assert requests_served(url) - before == 1
    sched.request_finished(hit, [])
    assert "hit" not in sched._lookups


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_lookup_and_exists_is_one_request_on_either_transport(shared_server, transport: str) -> None:
    from kvstore.sdk import Store  # noqa: PLC0415

    kv = torch.zeros(2, 1, 16, 1, 8, dtype=torch.bfloat16)
    k0, k1, gone, gone2 = (f"{i:02x}" * 16 + transport.encode().hex().ljust(32, "0") for i in range(4))
    with Store.connect(shared_server.url, transport=transport) as store:
        store.batch_put([(k0, kv), (k1, kv)])
        store.lookup([k0])  # connected
        before = requests_served(shared_server.url)
        assert store.lookup_and_exists([k0, gone], [k1, gone2]) == (1, "not_stored", [True, False])
        assert requests_served(shared_server.url) - before == 1


def test_a_whole_hit_is_one_round_trip_from_lookup_to_loaded_kv(engines, kv_server) -> None:
    """A prefix hit from a same-host server, lookup and load: one request (the lookup); the chunks are
    scattered from the server's arena in place, found by its index. A server of its own: no other
    test's client talks to it while it counts. Best of 3 prompts: on a loaded box the server's
    heartbeat may be late (over STALE_S), and then the load rightly asks the server instead."""
    from tests.connectors.sim import make_config, prompt, truth_kv  # noqa: PLC0415

    config = make_config("float16", store_url=kv_server.url, namespace="whole-hit")
    a, b = engines(config, seed=1), engines(config, seed=2)
    b.prefill(Req("warm", prompt(300, seed=12)))  # b's clients connect and map the server's segment
    b.worker.flush()
    counts = b.worker.handle.store.backend.counts
    served = []
    for attempt in range(3):
        tokens = prompt(1024 + 16, seed=20 + attempt)
        a.prefill(Req(f"r{attempt}", tokens))
        a.worker.flush()
        req, in_place = Req(f"hit{attempt}", tokens), counts["in_place"]
        before = requests_served(kv_server.url)
        assert b.admit(req) == 1024
        b.step([(req, 16)])  # the load, then the 16 new tokens' forward (no full chunk to save)
        served.append((requests_served(kv_server.url) - before, counts["in_place"] - in_place))
        assert not b.load_errors
        assert torch.equal(b.read(req, 0, 1040), truth_kv(tokens, 0, 1040, torch.float16))
        if served[-1] == (1, 1):
            break
    assert served[-1] == (1, 1), f"(requests, in-place leases) per hit: {served}"
