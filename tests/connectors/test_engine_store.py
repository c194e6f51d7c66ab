"""SmolLM2 with `--kv-backend kvstore`: token-for-token the same output as without the store, a new
engine hits every full chunk, preempted requests come back from the store, and a working set four
times the engine's KV memory still reuses its prefixes through the store."""

from __future__ import annotations

import pytest

from tests.connectors.engine_util import doc, generate, llm, store_metrics

pytestmark = pytest.mark.slow
HITS = "vllm:external_prefix_cache_hits_total"
QUERIES = "vllm:external_prefix_cache_queries_total"


def test_store_on_is_token_identical_and_a_new_engine_hits_every_chunk(off, shared_server) -> None:
    prompts = [doc(520, 1), doc(300, 2)]
    want = generate(off, prompts)
    a = llm(kv_backend="kvstore", kv_store_url=shared_server.url)
    try:
        assert generate(a, prompts) == want
        saved = store_metrics(a)["kvstore_connector_saved_chunks_total"]
        assert saved >= 3  # 2 + 1 full chunks (+ earlier tests' when an engine shares the connection)
    finally:
        a.shutdown()
    b = llm(kv_backend="kvstore", kv_store_url=shared_server.url)  # a new engine: empty prefix cache
    try:
        before = store_metrics(b)
        assert generate(b, prompts) == want
        after = store_metrics(b)
    finally:
        b.shutdown()
    # every full chunk below the last prompt token: 520 -> 512, 300 -> 256
    assert after[HITS] - before[HITS] == 512 + 256
    assert after[QUERIES] - before[QUERIES] == 520 + 300


def test_working_set_four_times_the_kv_memory_reuses_prefixes_via_the_store(off) -> None:
    """9 documents of ~306 tokens through 39 blocks (624 tokens): 4.4x the engine's KV memory.

    The engine's own prefix cache is off, so every reuse below is the store's: requests preempted
    for memory come back by loading their saved chunks (the partial one saved at preemption too),
    and the second pass loads every document's.
    """
    docs = [doc(300, 10 + i) for i in range(9)]
    want = generate(off, docs)
    small = llm(
        kv_backend="kvstore", kv_store_url="local", max_model_len=600, num_kv_blocks=39,
        enable_prefix_caching=False,
    )  # fmt: skip
    try:
        assert generate(small, docs) == want
        first = store_metrics(small)
        assert small.engine.scheduler.num_preemptions > 0
        assert first["kvstore_connector_preempted_hits_total"] > 0, (
            "preempted requests reloaded from the store"
        )
        # full chunks alone come back in multiples of 256 tokens: the rest is the partial chunk that
        # the connector copied out when the request was preempted
        assert first["kvstore_connector_preempted_hits_total"] % 256 != 0
        assert generate(small, docs) == want  # the same documents again
        second = store_metrics(small)
    finally:
        small.shutdown()
    hits = second[HITS] - first[HITS]
    queries = second[QUERIES] - first[QUERIES]
    print(
        f"\nworking set 4.4x the KV memory, second pass: store hit rate {hits / queries:.1%} ({hits}/{queries} tokens)"
    )
    assert hits == 9 * 256, "every document's full chunk came back from the store"


def test_prompt_logprobs_compute_the_whole_prompt_but_still_save(off) -> None:
    """A request for prompt logprobs needs every prompt position's logits: it loads nothing from the
    store (nor the engine's cache) and its scores equal a cold engine's; what it computes is saved."""
    from kvstore.engine import SamplingParams

    prompt = doc(300, 40)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    cold = off.generate([prompt], params)[0]
    a = llm(kv_backend="kvstore", kv_store_url="local")
    try:
        first = a.generate([prompt], params)[0]
        before = store_metrics(a)
        assert before["kvstore_connector_saved_chunks_total"] >= 1, "its full chunk went to the store"
        a.engine.block_manager.reset_prefix_cache()
        out = a.generate([prompt], params)[0]
        after = store_metrics(a)
    finally:
        a.shutdown()
    assert after[HITS] == before[HITS] and out.num_cached_tokens == first.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for got in (first, out):
        assert [e.logprob for e in got.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in cold.prompt_logprobs[1:]], abs=1e-4
        )
        assert got.outputs[0].token_ids == cold.outputs[0].token_ids
