"""Real vLLM (bf16, greedy, SmolLM2) reuses KV through kvstore-server with KVStoreConnectorV1.

A kv_producer vLLM computes a prompt cold and stores it; a kv_consumer vLLM — a new process that never
saw the prompt — loads every full chunk and answers token for token like the cold run. The same
after the store is SIGKILLed and restarted on its disk tier; a corrupt chunk and a dead store fall back
to recompute with identical output. What vLLM stores is transformers' KV in the canonical layout.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvstore.blob import decode_blob
from kvstore.keys import KVLayout, chunk_keys
from tests.connectors.engine_util import doc
from tests.connectors.vllm.vllm_util import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]
PROMPT_TOKENS = 1600  # 6 full chunks of 256; vLLM's cap (last token recomputed) is 1536 = 12 blocks of 128
HIT = 1536
HITS = "vllm:external_prefix_cache_hits_total"


def layout(model_dir) -> KVLayout:
    import json  # noqa: PLC0415

    config = json.loads((model_dir / "config.json").read_text())
    return KVLayout.for_model(config, model=str(model_dir), kv_dtype="bfloat16", chunk_size=256)


def loaded_by_consumer(consumer, prompt: list[int]) -> tuple[dict, float]:
    before = consumer.metric(HITS)
    out = consumer.complete(prompt)
    return out, consumer.metric(HITS) - before


def test_a_new_vllm_loads_every_full_chunk_and_answers_like_the_cold_run(vllm_pair) -> None:
    producer, consumer = vllm_pair
    prompt = doc(PROMPT_TOKENS, 101)
    cold = producer.complete(prompt)
    assert cold["cached"] == 0
    out, hits = loaded_by_consumer(consumer, prompt)
    assert hits == HIT and out["cached"] == HIT
    assert out["tokens"] == cold["tokens"]
    # and vLLM's own prefix cache takes over from there: nothing more is asked of the store
    again, hits = loaded_by_consumer(consumer, prompt)
    assert again["tokens"] == cold["tokens"] and hits == 0 and again["cached"] >= HIT


def test_what_vllm_stores_is_transformers_kv_in_the_canonical_layout(vllm_pair, store, model_dir) -> None:
    import transformers  # noqa: PLC0415
    from kvstore.sdk import Store  # noqa: PLC0415

    producer, _ = vllm_pair
    prompt = doc(600, 102)  # 2 full chunks
    producer.complete(prompt, max_tokens=1)
    keys = chunk_keys(prompt, layout(model_dir))
    with Store.connect(store.url) as client:
        chunks = [decode_blob(client.get_blob(k)) for k in keys]
    got = torch.cat(chunks, dim=2).float()  # [2, layers, 512, kv_heads, head_dim]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([prompt[:512]]), use_cache=True).past_key_values
    want = torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    )  # [layers, 2, heads, tokens, dim]
    want = want.permute(1, 0, 3, 2, 4)
    assert got.shape == want.shape
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / scale
    assert err < 0.05, f"relative max error {err:.4f}: not transformers' KV"  # bf16 kernels vs fp32 HF
    # the tolerance tells KV apart: the same KV one token off is far outside it
    assert (got[:, :, 1:] - want[:, :, :-1]).abs().max().item() / scale > 0.3
    print(f"vLLM's stored KV vs transformers fp32: relative max error {err:.4f}")


def test_after_the_store_is_killed_and_restarted_on_disk_the_chunks_still_load(vllm_pair, store) -> None:
    producer, consumer = vllm_pair
    prompt = doc(PROMPT_TOKENS, 103)
    cold = producer.complete(prompt)
    store.restart()  # SIGKILL: only what the disk tier wrote survives
    out, hits = loaded_by_consumer(consumer, prompt)
    assert hits == HIT
    assert out["tokens"] == cold["tokens"]


def test_a_corrupt_chunk_is_recomputed_with_identical_output(vllm_pair, store, model_dir) -> None:
    producer, consumer = vllm_pair
    prompt = doc(PROMPT_TOKENS, 104)
    cold = producer.complete(prompt)
    store.kill()
    bad = store.blob_path(chunk_keys(prompt, layout(model_dir))[2])  # chunk 2 of 6: load 0-1, recompute 2-5
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    store.restart()  # the cpu tier is empty: every chunk comes from the disk, the bad one fails its checksum
    out, _ = loaded_by_consumer(consumer, prompt)
    assert out["tokens"] == cold["tokens"]
    stats = _stats(store)
    assert stats["corrupt"] == 1, stats


def test_a_dead_store_is_a_recompute_with_identical_output(vllm_pair, store) -> None:
    producer, consumer = vllm_pair
    prompt = doc(PROMPT_TOKENS, 105)
    cold = producer.complete(prompt)
    store.kill()
    try:
        t0 = time.monotonic()
        out, hits = loaded_by_consumer(consumer, prompt)
        assert hits == 0
        assert out["tokens"] == cold["tokens"]
        print(f"dead store: answered in {time.monotonic() - t0:.1f} s")
    finally:
        store.restart()


def _stats(store) -> dict:
    from tests.connectors.vllm.vllm_util import http_json  # noqa: PLC0415

    tiers = http_json(store.url + "/v1/stats")["tiers"]
    return {"corrupt": int(np.sum([t.get("corrupt", 0) for t in tiers]))}


def test_the_connectors_info_lines_are_in_vllms_log(vllm_pair) -> None:
    """vLLM's own logger carries the connector's lines: each process that built one says so, in
    vLLM's format (the scheduler side in EngineCore, the worker side in the Worker)."""
    import re  # noqa: PLC0415

    producer, _ = vllm_pair
    log = producer.tail(100_000)
    for role in ("SCHEDULER", "WORKER"):
        line = rf"INFO \d\d-\d\d \d\d:\d\d:\d\d \[vllm\.py:\d+\] KVStoreConnectorV1 \({role}, kv_producer\)"
        assert re.search(line, log), f"no {role} line in {producer.log}"


def test_kvstores_loads_and_saves_are_in_vllms_own_metrics(vllm_pair) -> None:
    """vLLM's /metrics carries the connector's stats (get_kv_connector_stats -> build_prom_metrics,
    labelled with the store's tiers) and the source of its hits (get_external_cache_hit_sources: this
    store has a cpu and a disk tier, and a lookup does not say which held a chunk: unspecified)."""
    producer, consumer = vllm_pair
    prompt = doc(PROMPT_TOKENS, 106)
    saved = producer.metric("vllm:kvstore_saved_chunks_total")
    loaded = consumer.metric("vllm:kvstore_loaded_tokens_total")
    by_source = consumer.metric("vllm:prompt_tokens_cached_by_source_total")
    producer.complete(prompt)
    consumer.complete(prompt)
    deadline = time.monotonic() + 30  # stats reach the API server with vLLM's next stats interval
    while consumer.metric("vllm:kvstore_loaded_tokens_total") - loaded < HIT and time.monotonic() < deadline:
        time.sleep(0.5)
    assert consumer.metric("vllm:kvstore_loaded_tokens_total") - loaded == HIT
    assert consumer.metric("vllm:kvstore_load_bytes_total") > 0
    assert producer.metric("vllm:kvstore_saved_chunks_total") - saved >= 6
    assert consumer.metric("vllm:prompt_tokens_cached_by_source_total") - by_source >= HIT
    import urllib.request  # noqa: PLC0415

    from tests.connectors.vllm.vllm_util import http_json  # noqa: PLC0415,F401

    with urllib.request.urlopen(consumer.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert 'tier="cpu+disk"' in text and 'source="external_unspecified"' in text
