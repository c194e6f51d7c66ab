"""vLLM (the kvstore connector) writes through server 1 of a fleet; a kvstore-engine on server 2 loads
that KV through the 3+3 Valkey Cluster (server 2's redis tier) and continues it token for token as a
cold kvstore-engine does."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvstore.engine import LLM, SamplingParams
from kvstore.sdk.remote import RemoteBackend

from tests.connectors.conftest import ServerProcess
from tests.connectors.engine_util import doc, free_port, store_metrics
from tests.connectors.vllm.vllm_util import MAX_TOKENS, VllmServer, agreement, requires_vllm, transfer_config
from tests.fleet.conftest import fleet_servers
from tests.valkey import ValkeyCluster

pytestmark = [pytest.mark.slow, requires_vllm]
HITS = "vllm:external_prefix_cache_hits_total"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory": "96MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def servers(
    cluster33: ValkeyCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    prefix = f"fleetvllm{uuid.uuid4().hex[:6]}:"
    with fleet_servers(
        cluster33, prefix, tmp_path_factory, "--tiers", "cpu,redis", "--cpu-capacity", "512MiB"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def vllm_on_server_1(
    servers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    from tests.connectors.vllm.vllm_util import vllm_device  # noqa: PLC0415

    if vllm_device() != "cpu":
        pytest.skip("this test runs the CPU build of vLLM")
    log: Path = tmp_path_factory.mktemp("vllm-fleet") / "vllm.log"
    server = VllmServer(ensure_smollm2(), free_port(), transfer_config(servers[0].url, "kv_both"), log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def redis_hits(url: str) -> int:
    client = RemoteBackend(url, read_index=False)
    try:
        return next(int(t["hits"]) for t in client.stats()["tiers"] if t["name"] == "redis")
    finally:
        client.close()


def test_kvstore_engine_on_server_2_reuses_what_vllm_wrote_through_server_1(
    servers: list[ServerProcess], vllm_on_server_1: VllmServer
) -> None:
    prompt = doc(1100, 4100 + uuid.uuid4().int % 1000)  # a topic no other test stored
    vllm_out = vllm_on_server_1.complete(prompt)["tokens"]  # answers once its 4 full chunks are stored
    cold = LLM("smollm2", **ENGINE)
    try:
        (out,) = cold.generate([prompt], GREEDY)
        want = list(out.outputs[0].token_ids)
    finally:
        cold.shutdown()
    before = redis_hits(servers[1].url)
    engine = LLM("smollm2", kv_backend="kvstore", kv_store_url=servers[1].url, **ENGINE)
    try:
        start = store_metrics(engine)[HITS]
        (out,) = engine.generate([prompt], GREEDY)
        got = list(out.outputs[0].token_ids)
        loaded = store_metrics(engine)[HITS] - start
    finally:
        engine.shutdown()
    print(
        f"\nkvstore-engine on vLLM's KV vs its own cold: {agreement(got, want)}; vLLM vs engine cold: {agreement(vllm_out, want)}"
    )
    assert loaded == 1024  # the 4 full 256-token chunks vLLM stored through server 1
    assert redis_hits(servers[1].url) - before >= 4  # server 2 read them from the Cluster
    assert got == want
