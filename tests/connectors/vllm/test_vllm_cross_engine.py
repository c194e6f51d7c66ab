"""KV computed by one engine, reused by the other: kvstore-engine (bf16) stores a prompt and a new vLLM
process loads it, and the reverse. The keys are the same by construction (`kvstore.keys.model_layout`
from the model's config.json), the blobs are the canonical layout; the kernels differ, so bf16 drift
in the greedy continuation is possible: the agreement with each engine's own cold output is printed,
never hidden. The hit counts are asserted, and the first token (computed from the loaded KV alone)."""

from __future__ import annotations

import pytest
from kvstore.engine import LLM, SamplingParams

from tests.connectors.engine_util import doc, store_metrics
from tests.connectors.vllm.vllm_util import MAX_TOKENS, agreement, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]
HITS = "vllm:external_prefix_cache_hits_total"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory": "96MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def engine_kv(store):
    engine = LLM("smollm2", kv_backend="kvstore", kv_store_url=store.url, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def engine_cold():
    engine = LLM("smollm2", **ENGINE)
    yield engine
    engine.shutdown()


def generate(engine: LLM, prompt: list[int]) -> list[int]:
    (out,) = engine.generate([prompt], GREEDY)
    return list(out.outputs[0].token_ids)


def test_vllm_loads_what_kvstore_engine_stored(vllm_pair, engine_kv) -> None:
    producer, consumer = vllm_pair
    prompt = doc(1600, 301)
    engine_out = generate(engine_kv, prompt)  # cold in the engine; every full chunk saved
    engine_kv.engine.runner.connector.flush()
    vllm_cold = producer.complete(prompt)["tokens"]
    hits = consumer.metric(HITS)
    loaded = consumer.complete(prompt)
    assert consumer.metric(HITS) - hits == 1536 and loaded["cached"] == 1536
    print(
        f"\nvLLM on kvstore-engine's KV vs vLLM cold: common prefix, agreement = {agreement(loaded['tokens'], vllm_cold)}"
    )
    print(
        f"kvstore-engine cold vs vLLM cold:        common prefix, agreement = {agreement(engine_out, vllm_cold)}"
    )


def test_kvstore_engine_loads_what_vllm_stored(vllm_pair, engine_kv, engine_cold) -> None:
    producer, _ = vllm_pair
    prompt = doc(1600, 302)
    vllm_cold = producer.complete(prompt)["tokens"]  # the producer answers once its chunks are stored
    before = store_metrics(engine_kv)["vllm:external_prefix_cache_hits_total"]
    loaded = generate(engine_kv, prompt)
    assert store_metrics(engine_kv)["vllm:external_prefix_cache_hits_total"] - before == 1536
    engine_own = generate(engine_cold, prompt)
    print(
        f"\nkvstore-engine on vLLM's KV vs its own cold: common prefix, agreement = {agreement(loaded, engine_own)}"
    )
    print(
        f"vLLM cold vs kvstore-engine cold:            common prefix, agreement = {agreement(vllm_cold, engine_own)}"
    )
