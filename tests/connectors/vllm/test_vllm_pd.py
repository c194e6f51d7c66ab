"""Prefill/decode with real vLLM: `kvstore-engine proxy` sends a request to the kv_producer vLLM (one
token; its prompt KV goes to the store before it answers) and then to the kv_consumer vLLM (loads it,
decodes). The answer is a single vLLM's, token for token."""

from __future__ import annotations

import pytest

from tests.connectors.engine_util import doc
from tests.connectors.vllm.vllm_util import Proxy, complete, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]
HITS = "vllm:external_prefix_cache_hits_total"
GENERATED = "vllm:generation_tokens_total"


def test_producer_and_consumer_through_the_proxy_answer_like_one_vllm(vllm_pair) -> None:
    producer, consumer = vllm_pair
    prompt = doc(1600, 201)
    proxy = Proxy(producer.url, consumer.url)
    try:
        generated, hits = producer.metric(GENERATED), consumer.metric(HITS)
        got = complete(proxy.url, prompt)
        assert producer.metric(GENERATED) - generated == 1, "the prefill instance stops after one token"
        assert consumer.metric(HITS) - hits == 1536, "the decode instance loads every full chunk"
    finally:
        proxy.stop()
    # one vLLM computing it cold (the salt keeps the producer's own prefix cache out of it)
    want = producer.complete(prompt, cache_salt="reference")
    assert want["cached"] == 0
    assert got["tokens"] == want["tokens"]
